"""The process environment: the one module of batchgen that reads ``os.environ``.

Each function reads its variables when called; callers call them once, where a run starts (the engine's
constructor, the model resolver, the CLI), and pass the values down.
"""

from __future__ import annotations

import os
import sys

from batchgen.kernels.switches import KernelSwitches


def kernel_switches() -> KernelSwitches:
    """The kernel switches the environment sets (see :class:`KernelSwitches`).

    Raises:
        BatchgenError: ``$BATCHGEN_TRITON_FUSED_OPS`` is neither on nor off.
    """
    return KernelSwitches.from_environment(os.environ)


def cache_variables() -> tuple[str, str]:
    """``($BATCHGEN_CACHE, $XDG_CACHE_HOME)``, ``""`` for an unset one."""
    return os.environ.get("BATCHGEN_CACHE", ""), os.environ.get("XDG_CACHE_HOME", "")


def hub_offline() -> bool:
    """Whether ``$HF_HUB_OFFLINE`` or ``$TRANSFORMERS_OFFLINE`` forbids the network (``1``/``on``/``yes``/``true``).

    Read at each call: huggingface_hub reads it once at its import, which transformers may have done already."""
    return any(
        os.environ.get(var, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def replica_environment() -> dict[str, str]:
    """The variables of this process that an engine started elsewhere for it (a Ray replica, maybe on another node)
    must see too: batchgen's (kernel switches, cache), the Hugging Face hub's (offline, cache; not its token, which
    Ray would show on its dashboard) and ``$OMP_WAIT_POLICY`` (:func:`keep_openmp_threads_spinning`)."""
    return {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("BATCHGEN_", "HF_", "TRANSFORMERS_")) and "TOKEN" not in k or k == "OMP_WAIT_POLICY"
    }


def malloc_tuned_by_user() -> bool:
    """Whether ``$GLIBC_TUNABLES`` sets a ``glibc.malloc`` value (the user's choice then wins over batchgen's)."""
    return "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")


def thread_count_chosen() -> bool:
    """Whether ``$OMP_NUM_THREADS`` sets the number of threads torch computes with."""
    return bool(os.environ.get("OMP_NUM_THREADS", "").strip())


def keep_openmp_threads_spinning() -> bool:
    """Set ``$OMP_WAIT_POLICY=ACTIVE`` for this process unless the user set it; return whether it was set here.

    PyTorch's CPU ops run on OpenMP threads (GNU libgomp), which by default sleep in the kernel soon after each
    parallel region; a forward pass is hundreds of short regions with Python in between, and waking the threads
    for each cost a third of a batch-1 decode step (docs/performance.md). ACTIVE keeps them spinning while the
    process lives, as a dedicated batch job wants. libgomp reads the variable when it loads, with torch, so this
    runs before torch is imported (the CLI's entry point) and does nothing once it is.
    """
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    return True
