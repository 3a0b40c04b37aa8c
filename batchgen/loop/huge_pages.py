"""Put the weights batchgen's CPU kernels read on 2 MiB pages (Linux transparent huge pages).

A decode step reads every weight once, hundreds of megabytes over 4 KiB pages: each page is a TLB entry, and in a
virtual machine a TLB miss walks two page tables. Linux backs a region with 2 MiB pages where the process asks for
it with ``madvise(MADV_HUGEPAGE)`` before the region is first touched (the default ``transparent_hugepage/enabled``
setting, ``madvise``, gives them to no one else). The weights are copied once into fresh anonymous mappings that ask
for them. oneDNN's packed weights (float32 models, and half-precision ones whose dtype oneDNN runs, unless
``--deterministic`` puts them on brgemm) are opaque tensors and stay where oneDNN put them; the brgemm-packed and
half-precision weights of batchgen's own kernels move. What it gains,
and why the KV pool stays on small pages, is measured in docs/performance.md.
"""

from __future__ import annotations

import functools
import mmap
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from batchgen.loop.cpu_malloc import release_freed_memory

HUGE_PAGE = 2 << 20  # bytes; x86-64's and arm64's (4 KiB base pages) transparent huge page size
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_ARENA_BYTES = 256 << 20  # storages copied per arena (one larger storage gets its own), the most held twice at once


@functools.cache
def huge_pages_offered() -> bool:
    """Whether this Linux gives transparent huge pages to a region that asks (``enabled`` reads ``[always]`` or
    ``[madvise]``), and Python's ``mmap`` can ask."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE") or not _THP_MODE.exists():
        return False
    return "[never]" not in _THP_MODE.read_text()


def _huge_page_arena(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` that starts on a 2 MiB boundary, in a fresh anonymous mapping that asked for huge
    pages before anything was written to it (``torch.frombuffer`` keeps the mapping alive while the tensor is)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # shared memory has its own THP switch
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def _module_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """The tensors the modules of ``model`` hold directly: parameters, buffers, and tensor attributes (the packed
    weights of :class:`~batchgen.models.packed_linear.PackedLinear`); not those inside containers or other objects."""
    for module in model.modules():
        yield from module.parameters(recurse=False)
        yield from module.buffers(recurse=False)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                yield value


def _move_arena(keys: list[int], views: dict[int, list[torch.Tensor]]) -> None:
    """Copy the storages of ``views[key]`` for each of ``keys`` (their old storage's address) into one huge-page arena
    and point each of those tensors at its storage's copy, with the same offset, shape and strides; the old storage
    is freed once its last tensor moves (nothing else here holds it)."""
    # 64 bytes: a cache line, and every dtype's size divides it.
    sizes = [-(-views[key][0].untyped_storage().nbytes() // 64) * 64 for key in keys]
    arena = _huge_page_arena(sum(sizes))
    target, offset = arena.untyped_storage(), arena.storage_offset()
    for key, size in zip(keys, sizes, strict=True):
        tensors = views.pop(key)
        old = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage())
        arena_at = offset - arena.storage_offset()
        arena[arena_at : arena_at + old.numel()].copy_(old)
        del old
        for tensor in tensors:
            item = tensor.element_size()
            tensor.set_(target, offset // item + tensor.storage_offset(), tensor.size(), tensor.stride())
        offset += size


@torch.no_grad()
def move_to_huge_pages(model: nn.Module) -> int:
    """Move the CPU storages of ``model``'s tensors (:func:`_module_tensors`) onto huge pages, in arenas of up to
    256 MiB (one larger storage alone in its own), and return the bytes moved: 0 where
    :func:`huge_pages_offered` is false or they add up to less than one huge page.

    Every tensor keeps its identity, dtype, shape, strides and values (``Tensor.set_``), so whatever holds it (a
    tied LM head, a layer's weights captured for one C++ call) reads the moved copy; tensors that shared a storage
    share its copy. Opaque tensors (oneDNN's packed ``torch._mkldnn`` weights) stay where they are. Each arena's old
    storages are freed as it is filled, and the C library's freed memory handed back at the end
    (:func:`~batchgen.loop.cpu_malloc.release_freed_memory`), so the process holds at most one arena twice.
    """
    if not huge_pages_offered():
        return 0
    views: dict[int, list[torch.Tensor]] = {}  # by storage address: every tensor viewing that storage
    nbytes: dict[int, int] = {}
    for tensor in _module_tensors(model):
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.untyped_storage().nbytes() == 0:
            continue
        key = tensor.untyped_storage().data_ptr()
        nbytes[key] = tensor.untyped_storage().nbytes()
        if all(seen is not tensor for seen in views.setdefault(key, [])):
            views[key].append(tensor)
    total = sum(nbytes.values())
    if total < HUGE_PAGE:
        return 0
    arena: list[int] = []
    for key, size in nbytes.items():
        if arena and sum(nbytes[k] for k in arena) + size > _ARENA_BYTES:
            _move_arena(arena, views)
            arena = []
        arena.append(key)
    _move_arena(arena, views)
    release_freed_memory()
    return total
