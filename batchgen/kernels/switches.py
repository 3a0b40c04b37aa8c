"""Kernel switches: the environment variables that choose between kernels which can differ in the last bits of a
result. Read once per engine (:func:`batchgen.environment.kernel_switches`), passed down to the model's loader and
the attention backend, and recorded in the output's metadata, which ``--resume`` compares."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from batchgen.errors import BatchgenError

# The variable of Triton's fused elementwise kernels.
TRITON_FUSED_OPS = "BATCHGEN_TRITON_FUSED_OPS"
# The switches of kernels in batchgen's C++ extension: where it does not build, the PyTorch code runs in their place.
EXTENSION_SWITCHES = ("cpu_attention_kernel", "cpu_fused_ops", "cpu_half_weight_linear")
# Spellings of on and off, Triton's for its boolean environment variables.
_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


@dataclass(frozen=True)
class KernelSwitches:
    """Which kernels run, each field set by the variable its metadata names.

    A ``True`` default is turned off by ``0``/``false``/``off``/``no`` (any other value keeps it on); a ``False``
    default is turned on by ``1``/``true``/``on``/``yes``; ``None`` (automatic) takes only on or off values.
    """

    # batchgen's C++ paged attention on CPU tensors (and greedy sampling's argmax, built with it).
    cpu_attention_kernel: bool = field(default=True, metadata={"env": "BATCHGEN_CPU_ATTENTION_KERNEL"})
    # The fused RMSNorm, SiLU-and-multiply and RoPE of bfloat16 models on the CPU.
    cpu_fused_ops: bool = field(default=True, metadata={"env": "BATCHGEN_CPU_FUSED_OPS"})
    # Float32 GEMM outputs handed to the fused ops unrounded (bfloat16 models whose GEMMs run in float32).
    cpu_float32_carrier: bool = field(default=True, metadata={"env": "BATCHGEN_CPU_FLOAT32_CARRIER"})
    # oneDNN-prepacked linear weights on the CPU.
    cpu_prepack: bool = field(default=True, metadata={"env": "BATCHGEN_CPU_PREPACK"})
    # Half-precision linear layers in float32 on their own weights where oneDNN has no BF16/FP16 units for them.
    cpu_half_weight_linear: bool = field(default=True, metadata={"env": "BATCHGEN_CPU_HALF_WEIGHT_LINEAR"})
    # Triton's fused elementwise kernels; None: on a CUDA device where triton imports.
    triton_fused_ops: bool | None = field(default=None, metadata={"env": TRITON_FUSED_OPS})
    # Triton's interpreter, the only way its kernels run on CPU tensors (tests).
    triton_interpret: bool = field(default=False, metadata={"env": "TRITON_INTERPRET"})

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> KernelSwitches:
        """The switches ``environ`` sets (unset and empty variables keep the defaults).

        Raises:
            BatchgenError: a value of an automatic switch that is neither on nor off.
        """
        values: dict[str, bool | None] = {}
        for f in fields(cls):
            variable = f.metadata["env"]
            text = environ.get(variable, "").strip().lower()
            if f.default is True:
                values[f.name] = text not in _OFF
            elif f.default is False or text in _ON + _OFF:  # off by default, or automatic and set
                values[f.name] = text in _ON
            elif text:
                raise BatchgenError(f"{variable} must be 1 or 0, got '{text}'")
        return cls(**values)  # type: ignore[arg-type]

    @property
    def use_extension(self) -> bool:
        """Whether any kernel of batchgen's C++ extension is switched on (:data:`EXTENSION_SWITCHES`)."""
        return any(getattr(self, name) for name in EXTENSION_SWITCHES)

    def as_run_on(self, device_type: str) -> KernelSwitches:
        """These switches as a run on a ``device_type`` device (``cpu``, ``cuda``) runs them: on a CPU where
        batchgen's C++ extension does not build (:func:`batchgen.kernels.cpu.build_problem`, which builds it once a
        process), with its kernels off, as the output's metadata must record them (found by a helper: such a run
        recorded them on, and its ``--resume`` on a machine that built them mixed two paths' last bits)."""
        if device_type != "cpu" or not self.use_extension:
            return self
        from batchgen.kernels.cpu import build_problem  # the build, only where a CPU run would use it

        return replace(self, **dict.fromkeys(EXTENSION_SWITCHES, False)) if build_problem() is not None else self

    def as_metadata(self, device_type: str) -> dict[str, bool | None]:
        """The switches by variable name, as the output of a run on a ``device_type`` device (``cpu``, ``cuda``)
        records them. On a CPU, Triton's fused ops turned off are recorded as left automatic (``None``): automatic
        picks them on CUDA only, so both run the same kernels there (found by a helper: ``--resume`` took the two
        for a change of settings)."""
        recorded: dict[str, bool | None] = {f.metadata["env"]: getattr(self, f.name) for f in fields(self)}
        if device_type == "cpu" and self.triton_fused_ops is False:
            recorded[TRITON_FUSED_OPS] = None
        return recorded
