"""Put a CPU model's weights on 2 MiB pages (Linux transparent huge pages).

A decode step reads every weight once, hundreds of megabytes over 4 KiB pages: each page is a TLB entry, and in a
virtual machine a TLB miss walks two page tables. Linux backs a region with 2 MiB pages where the process asks for
it with ``madvise(MADV_HUGEPAGE)`` before the region is first touched (the default ``transparent_hugepage/enabled``
setting, ``madvise``, gives them to no one else). What it gains, and why the KV pool stays on small pages, is
measured in docs/performance.md. Where the kernel has no such pages, or the C library no ``madvise``, nothing
changes.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn

HUGE_PAGE = 2 << 20  # bytes; x86-64's and arm64's (4 KiB base pages) transparent huge page size
_MADV_HUGEPAGE = 14  # Linux's asm-generic/mman-common.h
_GROUP_BYTES = 256 << 20  # weights moved per arena, so that moving them never holds a whole second copy


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise(addr, length, advice)``, or ``None`` off Linux or where the C library lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    function = getattr(ctypes.CDLL(None), "madvise", None)
    if function is None:
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def _advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask Linux for 2 MiB pages under the whole 2 MiB-aligned stretches of ``tensor``'s storage (a CPU tensor not
    yet written: pages already touched keep their size). Does nothing for other devices, for storages too small
    to hold such a stretch, or where :func:`_madvise` is ``None``; a refused request (no transparent huge pages in
    this kernel) is ignored, since the tensor works the same on small pages."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return
    storage = tensor.untyped_storage()
    start = -(-storage.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (storage.data_ptr() + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)


def _module_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor the modules of ``model`` hold: parameters, buffers, and tensors kept as plain attributes (the
    packed weights of :class:`~batchgen.models.packed_linear.PackedLinear`)."""
    for module in model.modules():
        yield from module.parameters(recurse=False)
        yield from module.buffers(recurse=False)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                yield value


def _move_group(storages: list[torch.UntypedStorage], views: dict[int, list[torch.Tensor]]) -> None:
    """Copy ``storages`` into one new arena on huge pages and point every tensor of ``views`` (keyed by its old
    storage's address) at its storage's copy, with the same offset, shape and strides."""
    sizes = [-(-s.nbytes() // 64) * 64 for s in storages]  # 64: every dtype's size divides it, a cache line
    arena = torch.empty(sum(sizes) + HUGE_PAGE, dtype=torch.uint8)
    _advise_huge_pages(arena)
    offset = -arena.data_ptr() % HUGE_PAGE  # the first huge page's start: the whole arena on huge pages
    target = arena.untyped_storage()
    for storage, size in zip(storages, sizes, strict=True):
        old = torch.empty(0, dtype=torch.uint8).set_(storage)
        arena[offset : offset + storage.nbytes()].copy_(old)
        for tensor in views[storage.data_ptr()]:
            item = tensor.element_size()
            tensor.set_(target, offset // item + tensor.storage_offset(), tensor.size(), tensor.stride())
        offset += size


@torch.no_grad()
def move_to_huge_pages(model: nn.Module) -> int:
    """Move the CPU storages of ``model``'s tensors (:func:`_module_tensors`) onto huge pages
    (:func:`_advise_huge_pages`), in arenas of up to 256 MiB each, and return the bytes moved: 0 where they add up to
    less than one huge page.

    Every tensor keeps its identity, dtype, shape, strides and values (``Tensor.set_``), so whatever holds it (a
    tied LM head, a layer's weights captured for one C++ call) reads the moved copy; tensors that shared a storage
    share its copy. Opaque tensors (oneDNN's packed ``torch._mkldnn`` weights) stay where they are. Nothing moves
    where :func:`_madvise` is ``None``.
    """
    if _madvise() is None:
        return 0
    views: dict[int, list[torch.Tensor]] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in _module_tensors(model):
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            continue
        key = storage.data_ptr()
        storages.setdefault(key, storage)
        if all(seen is not tensor for seen in views.setdefault(key, [])):
            views[key].append(tensor)
    if sum(s.nbytes() for s in storages.values()) < HUGE_PAGE:
        return 0
    moved, group_bytes = 0, 0
    group: list[torch.UntypedStorage] = []
    for storage in storages.values():
        group.append(storage)
        group_bytes += storage.nbytes()
        if group_bytes >= _GROUP_BYTES:
            _move_group(group, views)
            moved, group, group_bytes = moved + group_bytes, [], 0
    if group:
        _move_group(group, views)
    return moved + group_bytes
