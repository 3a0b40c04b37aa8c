"""HF transformers float32 references and how far a run departs from them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
)


@dataclass
class Deviation:
    """How a greedy run departs from a reference run: |logprob difference| at each step before its row's first
    parting, and the reference's top-2 margin where a row parts."""

    diffs: list[float]
    parting_margins: list[float]
    total_steps: int

    @property
    def max(self) -> float:
        return max(self.diffs)

    @property
    def mean(self) -> float:
        return sum(self.diffs) / len(self.diffs)


def deviation(ref: dict[str, dict[str, Any]], got: dict[str, dict[str, Any]]) -> Deviation:
    """Rows by id (``read_rows``) with ``output_logprobs`` and ``top_logprobs`` of at least 2."""
    result = Deviation([], [], 0)
    for rid, r in ref.items():
        g = got[rid]
        assert len(g["output_token_ids"]) == len(r["output_token_ids"]), rid
        result.total_steps += len(r["output_token_ids"])
        for step, (a, b) in enumerate(zip(r["output_token_ids"], g["output_token_ids"])):
            if a != b:
                top = r["top_logprobs"][step]
                result.parting_margins.append(top[0]["logprob"] - top[1]["logprob"])
                break
            result.diffs.append(abs(r["output_logprobs"][step] - g["output_logprobs"][step]))
    return result


def greedy_rows(lengths: tuple[int, ...], new_tokens: int, seed: int) -> list[dict[str, Any]]:
    """Rows of random prompt ids (BOS 0 first) of the given lengths for ``hf_float32_rows`` comparisons: greedy,
    EOS ignored, ``new_tokens`` each, the top 2 logprobs reported (for ``deviation``)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "id": f"r{n}",
            "prompt_token_ids": [0] + torch.randint(2, 390, (n - 1,), generator=gen).tolist(),
            "max_new_tokens": new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "top_logprobs": 2,
        }
        for n in lengths
    ]


def hf_float32_rows(model_dir: Path, rows: list[dict[str, Any]], new_tokens: int) -> dict[str, dict[str, Any]]:
    """HF transformers' greedy continuation of each row alone, in float32: output ids, their raw logprobs and
    the top 2 of every step, as ``read_rows`` gives batchgen's."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = {}
    for row in rows:
        ids = torch.tensor([row["prompt_token_ids"]])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        new_ids = out.sequences[0, ids.shape[1] :].tolist()
        logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
        reference[row["id"]] = {
            "output_token_ids": new_ids,
            "output_logprobs": [lp[t].item() for lp, t in zip(logprobs, new_ids)],
            "top_logprobs": [[{"logprob": v} for v in lp.topk(2).values.tolist()] for lp in logprobs],
        }
    return reference


def assert_within_rounding_noise(dev: Deviation, noise: Deviation, label: str) -> None:
    """A half-precision run's deviation from float32 against ``noise``, torch_native's in the same dtype: within
    twice its largest error at every step and 1.5 times its mean, parting only at near-ties (top-2 margin within
    twice the largest error), and at least half the steps compared."""
    summary = (
        f"{label}: max {dev.max:.3g}, mean {dev.mean:.3g} over {len(dev.diffs)}/{dev.total_steps} steps, partings "
        f"at margins {[round(m, 4) for m in dev.parting_margins]}; noise: max {noise.max:.3g}, mean {noise.mean:.3g}"
    )
    print(summary)
    assert dev.max <= 2 * noise.max and dev.mean <= 1.5 * noise.mean, summary
    assert all(m <= 2 * noise.max for m in dev.parting_margins), summary
    assert len(dev.diffs) >= dev.total_steps / 2, summary


def assert_within(got: torch.Tensor, expected: torch.Tensor, places: float, scale: float = 1.0) -> None:
    """|got - expected| <= places * eps * (|expected| + scale), with eps the epsilon of ``got``'s dtype."""
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.double(), expected.double(), rtol=places * eps, atol=places * eps * scale)
