"""Shared fixtures: tiny random-weight models of every supported architecture, the stories260k model, and a
helper that runs ``batchgen run`` in-process."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)
from typer.testing import CliRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)
# The thread count chosen, here and in the runs tests start as subprocesses: batchgen then does not warn that a busy
# machine (the test suite itself) slows it down, which would add a line to the output the tests compare.
os.environ.setdefault("OMP_NUM_THREADS", "2")

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260k"
GREEDY_REFERENCE = SHARED / "models" / "greedy_reference.json"

needs_shared = pytest.mark.skipif(
    not STORIES.exists(), reason="needs ../shared/models (the workplace's shared folder; not in a fresh clone)"
)

_CORPUS = [
    "Once upon a time there was a little girl named Lily who loved to play in the park.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps by the fire.",
    "Numbers like 12345 and symbols such as #, %, & and emoji 🙂 appear in text too.",
    "Café, naïve and jalapeño use accents; 日本語 and русский use other scripts.",
] * 4


def build_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style) trained on a tiny corpus: 256 bytes + merges + <s>, </s>; adds BOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.save_pretrained(out_dir)
    return fast


ARCH_CONFIGS: dict[str, Callable[..., Any]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
}


def build_random_model(out_dir: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight model of ``arch`` (hidden 64, 2 layers, GQA 4/2 heads) with our test tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    kwargs: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        rms_norm_eps=1e-5,
    )
    if arch in ("qwen2", "qwen3"):
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    config = ARCH_CONFIGS[arch](**kwargs)
    config.architectures = [type(AutoModelForCausalLM.from_config(config)).__name__]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Larger-than-default weights give peaked next-token distributions, so greedy paths have clear margins.
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def random_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch name → directory of a saved tiny random model."""
    root = tmp_path_factory.mktemp("models")
    return {arch: build_random_model(root / arch, arch) for arch in ARCH_CONFIGS}


@pytest.fixture
def every_draft_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pin the draft budget to "verify every draft". Its round-cost fit is timed, so on a loaded machine it can
    hold drafts back, and tests that count accepted drafts would then vary between runs."""
    from batchgen.loop.round_cost import RoundCostModel

    monkeypatch.setattr(RoundCostModel, "break_even", lambda self, batch_size: 0.0)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def run_cli(args: list[str]) -> tuple[int, str]:
    """Run ``batchgen`` in this process; return (exit code, stderr + stdout)."""
    from batchgen.cli.app import app

    result = CliRunner().invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def read_rows(path: Path) -> dict[str, dict[str, Any]]:
    """Output rows by id."""
    from batchgen.io.writer import read_results

    return {r["id"]: r for r in read_results(path).to_pylist()}


def run_args(dataset: Path, out: Path, model: Path | str, *extra: str) -> list[str]:
    """Arguments of ``batchgen run`` in fp32 on CPU, overwriting ``out``."""
    return [
        "run",
        str(dataset),
        "--out",
        str(out),
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--no-progress",
        "--overwrite",
        *extra,
    ]


def generate(dataset: Path, out: Path, model: Path | str, *extra: str) -> dict[str, dict[str, Any]]:
    """``batchgen run`` in fp32 on CPU, asserting success; the rows by id."""
    code, output = run_cli(run_args(dataset, out, model, *extra))
    assert code == 0, output
    return read_rows(out)


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
        max_samples=engine.max_running_requests,
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


def perturbed_copy(model_dir: Path, out: Path, scale: float = 0.005) -> Path:
    """Save ``model_dir``'s model with Gaussian noise of std ``scale`` (seeded) on its matrices, and its tokenizer:
    a draft model that agrees with the target often but not always."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.add_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


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
    from transformers import AutoModelForCausalLM

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


def use_triton_interpreter() -> None:
    """Call at the top of a test module, before it imports any Triton kernel: runs the kernels in Triton's CPU
    interpreter (``TRITON_INTERPRET=1``). Skips the module where triton is missing, and on a CUDA machine: the
    interpreter is chosen when a kernel is decorated, once per process, so setting it there would make every Triton
    kernel of the pytest run interpreted, the GPU tests' too (tests/test_cuda.py checks the compiled kernels)."""
    if torch.cuda.is_available():
        pytest.skip(
            "Triton's CPU interpreter tests; on a CUDA machine tests/test_cuda.py checks the compiled kernels",
            allow_module_level=True,
        )
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's import, which reads it
    pytest.importorskip("triton", reason="triton is not installed (pip install triton); its kernels cannot be tested")
