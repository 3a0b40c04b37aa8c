"""``silu_and_mul_by_rows`` (``--deterministic``'s SiLU on the CPU where PyTorch computes it): each row's bits are
those it gets alone, however many rows share the call, and the value is ``F.silu(gate) * up``'s."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from batchgen.models.row_invariant import silu_and_mul_by_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("width", [172, 1536])
def test_a_rows_bits_are_its_own(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    gate_up = (4 * torch.randn(1060, 2 * width, generator=gen)).to(dtype)
    gate, up = gate_up.split(width, dim=-1)
    # Row by row: alone, a row never shares a thread split with another. (F.silu(gate[:n]) * up[:n] over the same
    # rows differs from it in some row for about 4 in 10 of these row counts on a 2-core machine.)
    alone = torch.cat([F.silu(gate[j : j + 1]) * up[j : j + 1] for j in range(gate_up.shape[0])])
    for rows in range(1001, 1061, 3):  # ~1.7e5 elements and more: PyTorch would split them over threads
        assert torch.equal(silu_and_mul_by_rows(gate_up[:rows]), alone[:rows]), rows
    reference = F.silu(gate.double()) * up.double()
    tolerance = 2e-3 if dtype == torch.float16 else 1e-6
    assert torch.allclose(silu_and_mul_by_rows(gate_up).double(), reference, rtol=tolerance, atol=1e-6)
