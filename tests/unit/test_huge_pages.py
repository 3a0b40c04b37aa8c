"""Weights on 2 MiB pages (batchgen/loop/huge_pages.py): the same values, and huge pages where
Linux gives them (its own accounting in /proc/self/smaps is the reference)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from batchgen.loop import huge_pages
from batchgen.loop.huge_pages import HUGE_PAGE, move_to_huge_pages

_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_offered() -> bool:
    """Whether this Linux gives huge pages to a region that asks (its setting reads "[always]" or "[madvise]")."""
    return sys.platform.startswith("linux") and _THP_MODE.exists() and "[never]" not in _THP_MODE.read_text()


needs_thp = pytest.mark.skipif(
    not _thp_offered(), reason="Linux transparent huge pages absent or set to never on this machine"
)


def _huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of the mapping that holds ``address``, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
def test_a_moved_model_computes_the_same_logits_and_keeps_shared_and_viewed_weights() -> None:
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    packed = model.model.layers[0].mlp.down_proj
    packed.kept_view = packed.weight.detach().t()  # a plain attribute viewing a parameter, as PackedLinear keeps
    opaque = nn.Linear(64, 64).weight.detach().to_mkldnn()
    model.opaque = opaque  # oneDNN's packed weights are opaque: they stay as they are
    ids = torch.randint(0, 8192, (2, 12))
    with torch.no_grad():
        before = model(ids).logits
    embedding = model.model.embed_tokens.weight
    old = embedding.data_ptr()

    moved = move_to_huge_pages(model)

    assert moved >= 8192 * 256 * 4  # the embedding's storage at least, counted once though the LM head shares it
    assert embedding.data_ptr() != old
    assert model.lm_head.weight.data_ptr() == embedding.data_ptr()
    assert packed.kept_view.data_ptr() == packed.weight.data_ptr()
    assert torch.equal(packed.kept_view, packed.weight.t())
    assert model.opaque is opaque and opaque.is_mkldnn
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_a_model_smaller_than_one_huge_page_stays_where_it_is() -> None:
    layer = nn.Linear(16, 16)
    old = layer.weight.data_ptr()
    assert move_to_huge_pages(layer) == 0
    assert layer.weight.data_ptr() == old


@needs_thp
def test_arenas_hold_at_most_their_size_unless_one_storage_is_larger(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "_ARENA_BYTES", 4 << 20)
    mib = 1 << 20
    sizes = [mib, mib, mib, 3 * mib, 5 * mib, mib]  # float32 elements below: bytes / 4
    model = nn.ParameterList(
        [nn.Parameter(torch.full((n // 4,), float(i)), requires_grad=False) for i, n in enumerate(sizes)]
    )
    assert move_to_huge_pages(model) == sum(sizes)
    arenas = [p.untyped_storage().data_ptr() for p in model]
    # 1 + 1 + 1 MiB fill the first arena, 3 MiB would overflow it; 5 MiB is alone; the last 1 MiB opens a new one.
    assert arenas[0] == arenas[1] == arenas[2] != arenas[3] != arenas[4] != arenas[5] != arenas[3]
    assert all(torch.equal(p, torch.full_like(p, float(i))) for i, p in enumerate(model))


@needs_thp
def test_moved_weights_sit_on_huge_pages() -> None:
    model = nn.Linear(2048, 2048, bias=False).to(torch.bfloat16)  # 8 MiB
    move_to_huge_pages(model)
    assert _huge_kib_at(model.weight.data_ptr()) >= HUGE_PAGE // 1024
