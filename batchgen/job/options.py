"""Job options: how ``batchgen run`` treats bad rows, its output file and its terminal; declared as the engine's
are (:mod:`batchgen.loop.options`): default, ``help`` (and ``flag``) per field, a numeric field's bound as
``at_least`` (>=) or ``above`` (>), ``needs_ray`` where the flag means something only with ``--ray``; the rules in
:meth:`validate`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from batchgen.errors import BatchgenError

ON_ERROR = ("auto", "fail", "skip")
OUTPUT_FORMATS = ("auto", "batchgen", "openai")


@dataclass(frozen=True)
class JobOptions:
    """The job's side of ``batchgen run``; each field's meaning is its ``help``."""

    on_error: str = field(
        default="auto",
        metadata={
            "help": "fail: report bad rows, write the good ones and exit 3; skip: write them as error rows; auto: "
            "skip for OpenAI Batch output lines (an error line per bad request, as vllm run-batch writes), else fail.",
        },
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
            "flag": "--resume/--no-resume",
        },
    )
    resume_force: bool = field(
        default=False,
        metadata={
            "help": "Resume even if model, dtype, kernel switches, sampling defaults or dataset changed.",
            "flag": "--resume-force/--no-resume-force",
        },
    )
    schedule_lookahead: int = field(
        default=4096,
        metadata={
            "at_least": 1,
            "help": "Rows read ahead for the scheduler (at least 2x --max-running-requests): with the prefix cache "
            "it runs the rows among them that share a prompt prefix together, however the file interleaves them.",
        },
    )
    flush_every: int = field(
        default=256, metadata={"at_least": 1, "help": "Make finished rows durable at least every N rows..."}
    )
    flush_every_seconds: float = field(default=5.0, metadata={"above": 0, "help": "...and at least every S seconds."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar on stderr."})
    report_memory: bool = field(default=False, metadata={"help": "Print the peak resident memory (RSS) at the end."})
    ray: bool = field(
        default=False,
        metadata={
            "help": "Run on a Ray cluster: --replicas engines, one Ray actor each, share the rows (docs/scale-out.md; "
            "needs the ray extra).",
            "flag": "--ray/--no-ray",
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
        default=1, metadata={"at_least": 1, "needs_ray": True, "help": "With --ray: engines, each holding the model."}
    )
    gpus_per_replica: float = field(
        default=0.0, metadata={"at_least": 0, "needs_ray": True, "help": "With --ray: GPUs each replica holds."}
    )
    cpus_per_replica: float = field(
        default=1.0,
        metadata={
            "above": 0,
            "needs_ray": True,
            "help": "With --ray: CPU cores each replica holds (its torch threads).",
        },
    )
    ray_batch_rows: int = field(
        default=512,
        metadata={
            "at_least": 1,
            "needs_ray": True,
            "help": "With --ray: rows per batch a replica runs (what Ray retries on a failure).",
        },
    )

    def validate(self) -> None:
        """Every rule of these options.

        Raises:
            BatchgenError: one line naming the first bad flag and its value.
        """
        if self.overwrite and self.resuming:
            flag = "--resume" if self.resume else "--resume-force"
            raise BatchgenError(f"--overwrite and {flag} exclude each other: --overwrite starts over, {flag} continues")
        if self.on_error not in ON_ERROR:
            raise BatchgenError(f"--on-error must be auto, fail or skip, got '{self.on_error}'")
        if self.output_format not in OUTPUT_FORMATS:
            raise BatchgenError(f"--output-format must be auto, batchgen or openai, got '{self.output_format}'")
        for f in fields(self):
            value = getattr(self, f.name)
            if "at_least" in f.metadata and not value >= f.metadata["at_least"]:
                raise BatchgenError(f"--{_flag(f.name)} must be >= {f.metadata['at_least']}, got {value}")
            if "above" in f.metadata and not value > f.metadata["above"]:
                raise BatchgenError(f"--{_flag(f.name)} must be > {f.metadata['above']}, got {value}")
        if not self.ray:
            given = [f.name for f in fields(self) if f.metadata.get("needs_ray") and getattr(self, f.name) != f.default]
            if given:
                raise BatchgenError(f"--{_flag(given[0])} needs --ray")

    @property
    def resuming(self) -> bool:
        """Whether the run continues what is there: ``--resume``, or ``--resume-force``, which implies it."""
        return self.resume or self.resume_force

    def bad_rows(self, openai_lines: bool) -> str:
        """What ``on_error`` does with bad rows (``fail`` or ``skip``), for an output of OpenAI Batch lines or not:
        ``auto`` writes an OpenAI output's bad requests as error lines (vLLM's ``run-batch`` and OpenAI's Batch API
        give every request a line, and a JSON Lines output cannot be resumed to add them later)."""
        if self.on_error == "auto":
            return "skip" if openai_lines else "fail"
        return self.on_error


def _flag(name: str) -> str:
    """The CLI flag of field ``name``, without its dashes (``ray_batch_rows`` → ``ray-batch-rows``)."""
    return name.replace("_", "-")
