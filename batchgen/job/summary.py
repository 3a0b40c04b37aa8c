"""What a ``batchgen run`` did, as the one summary line it prints, and its exit status under ``--on-error``."""

from __future__ import annotations

import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.errors import BadRowsLeftOut, counted
from batchgen.io.finished_output import records_run
from batchgen.loop.options import EngineOptions


@dataclass
class RunSummary:
    """What a run did: rows written and failed, tokens in and out, wall seconds."""

    # Finished samples (requests): a row with n > 1 is n of them.
    samples: int = 0
    # Input rows whose every sample finished.
    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    preemptions: int = 0
    # The signal that stopped the run early, e.g. "SIGTERM"; empty when it ran to the end.
    interrupted_by: str = ""
    # What the run did with bad rows: fail (left out) or skip (written as error rows); JobOptions.bad_rows.
    on_error: str = "fail"
    # False when the run ended with no row to write (every row bad under --on-error fail): no output file then.
    output_written: bool = True
    # Share of the prompt tokens admitted for prefill that the prefix cache gave; None with the cache off.
    cached_share: float | None = None
    # Speculative decoding: decode rounds of one request by the tokens they emitted (1 … K + 1).
    accept_histogram: dict[int, int] = field(default_factory=dict)

    def line(self) -> str:
        rate = self.output_tokens / self.seconds if self.seconds > 0 else 0.0
        # Samples are named only where they differ from rows: "10 rows (30 samples)" for n = 3.
        samples = f" ({counted(self.samples, 'sample')})" if self.samples != self.rows else ""
        return (
            f"batchgen: {counted(self.rows, 'row')}{samples} done, {counted(self.errors, 'bad row')}, "
            f"{self.prompt_tokens} prompt + "
            f"{self.output_tokens} output tokens in {self.seconds:.1f} s, {rate:.1f} output tok/s, "
            f"{counted(self.preemptions, 'preemption')}"
            f"{'' if self.cached_share is None else ', ' + prefix_cache_text(self.cached_share)}"
        ) + speculative_summary(self.accept_histogram)


def prefix_cache_text(share: float) -> str:
    """``prefix cache 91 % of prompt tokens``: the share of the admitted prompt tokens the prefix cache served
    (``RoundStats.cached_share``), as the summary line and the bench line say it."""
    return f"prefix cache {100 * share:.0f} % of prompt tokens"


def mean_accept_length(histogram: dict[int, int]) -> float | None:
    """Mean tokens emitted per verify round with drafts (``histogram``: tokens → rounds); ``None`` for none."""
    rounds = sum(histogram.values())
    return sum(length * count for length, count in histogram.items()) / rounds if rounds else None


def speculative_summary(histogram: dict[int, int]) -> str:
    """``, accept length 2.31 (1:40 2:12 …)``: mean tokens per decode round and their histogram; empty
    without speculative decoding."""
    mean = mean_accept_length(histogram)
    if mean is None:
        return ""
    return f", accept length {mean:.2f} ({' '.join(f'{k}:{v}' for k, v in sorted(histogram.items()))})"


def speculative_record(options: EngineOptions, histogram: dict[int, int]) -> dict[str, Any]:
    """The speculative settings and acceptance of a benchmark's engine, for its JSON result lines: empty
    without speculative decoding."""
    if options.speculative_algorithm is None:
        return {}
    return {
        "speculative_algorithm": options.speculative_algorithm,
        "speculative_num_draft_tokens": options.speculative_num_draft_tokens,
        "speculative_draft_model": options.speculative_draft_model,
        "accept_length": mean_accept_length(histogram),
        "accept_histogram": dict(sorted(histogram.items())),
    }


def raise_if_failed(summary: RunSummary, out: Path) -> None:
    """Under ``--on-error fail`` a run with bad rows ends with an error after writing the good ones to ``out``; the
    message says how the fixed rows get there: ``--resume`` adds them to an Arrow or Parquet output, a JSON Lines
    output records nothing to resume from (found by a helper: it said only "--on-error skip writes them").

    Raises:
        BadRowsLeftOut: there were bad rows under ``--on-error fail``.
    """
    if summary.errors and summary.on_error == "fail":
        if not summary.output_written:
            then = "; no row was good, so no output file was written"
        elif not records_run(out):
            then = f"; {out} records nothing to resume from: once they are fixed, --overwrite runs the dataset again"
        else:
            then = "; once they are fixed, --resume adds them"
        raise BadRowsLeftOut(
            f"{counted(summary.errors, 'bad input row')} left out (see above; --on-error skip writes them){then}",
            summary,
        )


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
