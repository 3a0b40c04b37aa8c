"""What a ``batchgen run`` did, as the one summary line it prints, and its exit status under ``--on-error``."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.errors import BatchgenError


@dataclass
class RunSummary:
    """What a run did: rows written and failed, tokens in and out, wall seconds."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    preemptions: int = 0
    # The signal that stopped the run early, e.g. "SIGTERM"; empty when it ran to the end.
    interrupted_by: str = ""
    # Speculative decoding: decode rounds of one request by the tokens they emitted (1 … K + 1).
    accept_histogram: dict[int, int] = field(default_factory=dict)

    def line(self) -> str:
        rate = self.output_tokens / self.seconds if self.seconds > 0 else 0.0
        return (
            f"batchgen: {self.requests} requests ({self.errors} errors), {self.prompt_tokens} prompt + "
            f"{self.output_tokens} output tokens in {self.seconds:.1f} s, {rate:.1f} output tok/s, "
            f"{self.preemptions} preemptions"
        ) + speculative_summary(self.accept_histogram)


def speculative_summary(histogram: dict[int, int]) -> str:
    """``, accept length 2.31 (1:40 2:12 …)``: mean tokens per decode round and their histogram; empty
    without speculative decoding."""
    rounds = sum(histogram.values())
    if not rounds:
        return ""
    mean = sum(length * count for length, count in histogram.items()) / rounds
    return f", accept length {mean:.2f} ({' '.join(f'{k}:{v}' for k, v in sorted(histogram.items()))})"


def raise_if_failed(summary: RunSummary, on_error: str) -> None:
    """Under ``--on-error fail`` a run with bad rows ends with an error after writing the good ones."""
    if summary.errors and on_error == "fail":
        raise BatchgenError(f"{summary.errors} bad input rows were left out (see above; --on-error skip writes them)")
