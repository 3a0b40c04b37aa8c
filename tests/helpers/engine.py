"""Drive an Engine directly: enqueue rows as ``batchgen run`` builds them, spy on graph runs, sample first tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
)

from tests.helpers.cli import write_jsonl

# A stop string the test models' outputs never contain (four control bytes in a row): a row with it runs to its
# max_new_tokens all the same, but the scheduler cannot know that, so it estimates the row's growth and may admit
# more than the pool later holds. Tests of retraction give their rows this stop; rows that nothing can stop early
# are admitted only where their whole growth fits and are never retracted.
UNMATCHED_STOP = "\x00\x07\x1b\x7f"


def enqueue_rows(engine: Any, rows: list[dict[str, Any]], path: Path, *, eos: bool = True) -> None:
    """Add ``rows`` to ``engine`` as requests built the way ``batchgen run`` builds them (written to ``path`` as
    JSONL and read back; run seed 0); with ``eos`` false the model's EOS ids do not end them."""
    from batchgen.io.reader import RowReader
    from batchgen.io.rows import parse_row
    from batchgen.job.request_builder import RequestBuilder
    from batchgen.sampling.sampling_params import SamplingParams

    reader = RowReader(write_jsonl(path, rows))
    builder = RequestBuilder(
        engine.tokenizer,
        engine.vocab_size,
        engine.context_len,
        engine.eos_token_ids if eos else [],
        SamplingParams(),
        run_seed=0,
    )
    for item in reader:
        assert not isinstance(item, Exception), item
        engine.add(
            builder.build(
                parse_row(item, reader.source, reader.passthrough_schema, reader.passthrough_names),
                reader.source,
            )
        )


def spy_graph_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Record every round the graph runner serves, as (mode name, batch size, padded size), in order."""
    from batchgen.loop.cuda_graph_runner import CudaGraphRunner

    served: list[tuple[str, int, int]] = []
    original = CudaGraphRunner.run

    def spy(self: CudaGraphRunner, forward_batch: Any) -> Any:
        bs = forward_batch.batch_size
        served.append((forward_batch.forward_mode.name, bs, self.padded_size(bs)))
        return original(self, forward_batch)

    monkeypatch.setattr(CudaGraphRunner, "run", spy)
    return served


FIRST_TOKENS_PROMPT = [0, 17, 99, 5, 230, 41]


def sample_first_tokens(engine: Any, path: Path, max_new_tokens: int) -> list[Any]:
    """2,000 seeded samples (8 rows of ``n`` 250, top_k 5, temperature 1) of ``FIRST_TOKENS_PROMPT`` through
    ``engine`` to the end; asserts they all finish and every KV slot is free again (rejected drafts' too)."""
    rows = [
        {"id": str(k), "prompt_token_ids": FIRST_TOKENS_PROMPT, "n": 250, "seed": k, "top_k": 5}
        | {"max_new_tokens": max_new_tokens}
        for k in range(8)
    ]
    enqueue_rows(engine, rows, path, eos=False)
    finished = []
    while engine.has_work():
        finished += engine.step()
    assert len(finished) == 2000
    assert engine.kv_cache.available() == engine.kv_cache.size
    return finished


def assert_first_two_tokens_follow_top5(model_dir: Path, prompt: list[int], reqs: list[Any]) -> None:
    """The first two output tokens of ``reqs`` (sampled with top_k 5, temperature 1 after ``prompt``) follow the
    exact joint distribution computed here from HF transformers in float32 (chi-square p > 1e-3)."""
    import numpy as np
    from scipy.stats import chisquare

    def top5(context: list[int]) -> dict[int, float]:
        values, ids = hf(torch.tensor([context])).logits[0, -1].float().topk(5)
        return dict(zip(ids.tolist(), torch.softmax(values, -1).tolist()))

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        exact = {(t0, t1): p0 * p1 for t0, p0 in top5(prompt).items() for t1, p1 in top5([*prompt, t0]).items()}
    counts: dict[tuple[int, int], int] = {}
    for req in reqs:
        pair = (req.output_ids[0], req.output_ids[1])
        counts[pair] = counts.get(pair, 0) + 1
    assert set(counts) <= set(exact), "a token outside the top 5 was sampled"
    cells = sorted(exact)
    observed = np.array([counts.get(c, 0) for c in cells])
    expected = np.array([exact[c] for c in cells])
    assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3
