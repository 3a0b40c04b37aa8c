"""Job options: how ``batchgen run`` treats bad rows, its output file and its terminal; declared as the engine's
are (:mod:`batchgen.loop.options`): default, ``help`` (and ``flag``) per field, the rules in :meth:`validate`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from batchgen.errors import BatchgenError

ON_ERROR = ("fail", "skip")
OUTPUT_FORMATS = ("auto", "batchgen", "openai")


@dataclass(frozen=True)
class JobOptions:
    """The job's side of ``batchgen run``; each field's meaning is its ``help``."""

    on_error: str = field(
        default="fail", metadata={"help": "fail: report bad rows and exit 2 at the end; skip: write them."}
    )
    output_format: str = field(
        default="auto",
        metadata={
            "help": "batchgen: batchgen's columns; openai: OpenAI Batch output lines (.jsonl, OpenAI Batch input); "
            "auto: openai for an OpenAI Batch input and a .jsonl output, else batchgen.",
        },
    )
    overwrite: bool = field(
        default=False, metadata={"help": "Replace an existing output file (and discard a partial output)."}
    )
    resume: bool = field(
        default=False,
        metadata={
            "help": "Continue an interrupted run (keep the rows OUT.partial/ holds, generate the rest), or add "
            "the rows a finished OUT lacks.",
            "flag": "--resume",
        },
    )
    resume_force: bool = field(
        default=False,
        metadata={
            "help": "Resume even if model, dtype, kernel switches, sampling defaults or dataset changed.",
            "flag": "--resume-force",
        },
    )
    schedule_lookahead: int = field(
        default=4096,
        metadata={
            "help": "Rows read ahead for the scheduler (at least 2x --max-running-requests): with the prefix cache "
            "it runs the rows among them that share a prompt prefix together, however the file interleaves them.",
        },
    )
    flush_every: int = field(default=256, metadata={"help": "Make finished rows durable at least every N rows..."})
    flush_every_seconds: float = field(default=5.0, metadata={"help": "...and at least every S seconds."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar on stderr."})
    report_memory: bool = field(default=False, metadata={"help": "Print the peak resident memory (RSS) at the end."})
    ray: bool = field(
        default=False,
        metadata={
            "help": "Run on a Ray cluster: --replicas engines, one Ray actor each, share the rows (docs/scale-out.md; "
            "needs the ray extra).",
            "flag": "--ray",
        },
    )
    ray_address: str = field(
        default="auto",
        metadata={
            "needs_ray": True,
            "help": "With --ray: the cluster to join; auto: the one 'ray start' runs on this machine, else a new "
            "local one.",
        },
    )
    replicas: int = field(
        default=1, metadata={"needs_ray": True, "help": "With --ray: engines, each holding the model."}
    )
    gpus_per_replica: float = field(
        default=0.0, metadata={"needs_ray": True, "help": "With --ray: GPUs each replica holds."}
    )
    cpus_per_replica: float = field(
        default=1.0,
        metadata={"needs_ray": True, "help": "With --ray: CPU cores each replica holds (its torch threads)."},
    )
    ray_batch_rows: int = field(
        default=512,
        metadata={
            "needs_ray": True,
            "help": "With --ray: rows per batch a replica runs (what Ray retries on a failure).",
        },
    )

    def validate(self) -> None:
        """Every rule of these options.

        Raises:
            BatchgenError: one line naming the first bad flag and its value.
        """
        if self.on_error not in ON_ERROR:
            raise BatchgenError(f"--on-error must be fail or skip, got '{self.on_error}'")
        if self.output_format not in OUTPUT_FORMATS:
            raise BatchgenError(f"--output-format must be auto, batchgen or openai, got '{self.output_format}'")
        if self.schedule_lookahead < 1:
            raise BatchgenError(f"--schedule-lookahead must be >= 1, got {self.schedule_lookahead}")
        if self.flush_every < 1:
            raise BatchgenError(f"--flush-every must be >= 1, got {self.flush_every}")
        if not self.flush_every_seconds > 0:
            raise BatchgenError(f"--flush-every-seconds must be > 0, got {self.flush_every_seconds}")
        if self.replicas < 1:
            raise BatchgenError(f"--replicas must be >= 1, got {self.replicas}")
        if self.gpus_per_replica < 0:
            raise BatchgenError(f"--gpus-per-replica must be >= 0, got {self.gpus_per_replica}")
        if not self.cpus_per_replica > 0:
            raise BatchgenError(f"--cpus-per-replica must be > 0, got {self.cpus_per_replica}")
        if self.ray_batch_rows < 1:
            raise BatchgenError(f"--ray-batch-rows must be >= 1, got {self.ray_batch_rows}")
        if not self.ray:
            given = [f.name for f in fields(self) if f.metadata.get("needs_ray") and getattr(self, f.name) != f.default]
            if given:
                raise BatchgenError(f"--{given[0].replace('_', '-')} needs --ray")

    @property
    def resuming(self) -> bool:
        """Whether the run continues what is there: ``--resume``, or ``--resume-force``, which implies it."""
        return self.resume or self.resume_force
