"""Benchmark workloads: deterministic random-token prompts (with or without shared prefixes), or the prompts of a
dataset file."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.errors import BatchgenError, RowError
from batchgen.io.reader import RowReader
from batchgen.io.rows import parse_row
from batchgen.job.request_builder import RequestBuilder
from batchgen.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    """Prompts as token ids, each to be extended by exactly ``output_len`` tokens (EOS ignored)."""

    prompts: list[list[int]]
    output_len: int

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def random_workload(
    num_prompts: int,
    min_len: int,
    max_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
    repetitive: bool = False,
) -> Workload:
    """``num_prompts`` prompts with lengths uniform in ``[min_len, max_len]`` and token ids uniform in the
    vocabulary, the same for the same arguments. ``repetitive``: each prompt repeats a motif of 4–16 random
    tokens (text that repeats itself, where n-gram speculation pays)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        length = rng.randint(min_len, max_len)
        motif = _random_ids(rng, rng.randint(4, 16) if repetitive else length, vocab_size)
        prompts.append((motif * (length // len(motif) + 1))[:length])
    return Workload(prompts, output_len)


def shared_prefix_workload(
    num_prompts: int,
    num_groups: int,
    prefix_len: int,
    min_len: int,
    max_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
) -> Workload:
    """``num_groups`` random prefixes of ``prefix_len`` tokens, and ``num_prompts`` prompts: prompt ``i`` is
    prefix ``i % num_groups`` followed by a random question of a length uniform in ``[min_len, max_len]`` (the
    groups interleaved, as an evaluation file lists its items; as SGLang's generated-shared-prefix dataset).

    The same for the same arguments: one ``random.Random(seed)`` draws the prefixes' token ids first (prefix by
    prefix, each ``randrange(vocab_size)``), then per prompt the question's length (``randint(min_len,
    max_len)``) and its token ids.
    """
    rng = random.Random(seed)
    prefixes = [_random_ids(rng, prefix_len, vocab_size) for _ in range(num_groups)]
    prompts = []
    for i in range(num_prompts):
        length = rng.randint(min_len, max_len)
        prompts.append(prefixes[i % num_groups] + _random_ids(rng, length, vocab_size))
    return Workload(prompts, output_len)


def _random_ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(count)]


def dataset_workload(
    path: Path, tokenizer: Any, vocab_size: int, context_len: int, num_prompts: int, output_len: int
) -> Workload:
    """The first ``num_prompts`` valid rows of a ``batchgen run`` dataset, tokenized as ``run`` would; the rows
    skipped (invalid, or too long for ``context_len - output_len``) are counted on stderr with the first reason.

    Raises:
        BatchgenError: the file cannot be read, or it has no valid row.
    """
    reader = RowReader(path)
    builder = RequestBuilder(tokenizer, vocab_size, context_len - output_len, [], SamplingParams(), run_seed=0)
    prompts: list[list[int]] = []
    skipped: list[RowError] = []
    for item in reader:
        if len(prompts) == num_prompts:
            break
        if isinstance(item, RowError):
            skipped.append(item)
            continue
        try:
            prompts.append(
                builder.build(
                    parse_row(item, reader.source, reader.passthrough_schema, reader.passthrough_names),
                    reader.source,
                ).prompt_ids
            )
        except RowError as e:
            skipped.append(e)
    if skipped:
        # Not fatal (the benchmark needs prompts, not every row), but never silent: the workload is not the file.
        print(
            f"batchgen: skipped {len(skipped)} rows the benchmark cannot use; the first: {skipped[0]}", file=sys.stderr
        )
    if not prompts:
        raise BatchgenError(f"{path}: no valid prompt rows for the benchmark")
    if len(prompts) < num_prompts:
        print(
            f"batchgen: {path} has {len(prompts)} usable rows, fewer than --num-prompts {num_prompts}; the "
            "benchmark runs those",
            file=sys.stderr,
        )
    return Workload(prompts, output_len)
