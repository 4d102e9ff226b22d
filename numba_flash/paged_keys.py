"""Paged keys for packed sequences: ``block_table`` on a packed ("thd") call, flash-attn's paged prefill
(``flash_attn_varlen_func(..., block_table=...)``).

With ``block_table``, k and v are paged caches ``(num_blocks, page_size, Hkv, D)`` (v may have its own head dim)
and ``block_table`` ``(B, max_blocks)`` int32 lists each sequence's pages in order: sequence b has
``seqlen_k[b] = cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` keys, and its key j is
``k[block_table[b, j // page_size], j % page_size]``. Rows of a page past a sequence's last key, entries of its
table row past its last page, and pages no sequence lists are never read (they may hold anything).

How every backend serves it: the keys and values a call reads are gathered once into the packed
``(total_k, Hkv, D)`` layout (``PagedKeys.gather``) and the call runs as the packed call it then is, on whatever
backend the registry picks. The backward's dk and dv, packed, are added into zeros shaped like the paged k and v
(``PagedKeys.scatter``): each page row gets the gradient of the key it holds, and rows and pages no sequence reads
get 0. The cost is one copy of the keys read, per call; the kernels need no paged variant and the result is the
same, bit for bit, as the call with the keys already packed.

What is accepted, and why:

* Any page size >= 1. flash-attn requires a multiple of 256 on this path, a constraint of its kernels' tiles; the
  gather leaves ours independent of the page size, so every call flash-attn accepts is accepted, and so are the
  16-row pages of vLLM-style caches.
* A page listed by two sequences (prefix caching) or twice in one row is read wherever it is listed; its gradient
  is the sum over every place it was read.
* numpy arrays and torch tensors (any device) for k and v: their own indexing gathers and scatters. Other array
  kinds are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrays import array_kind
from .errors import bad_arg
from .kvcache import check_block_indices, host_ints
from .varlen import check_cu_seqlens

PAGED_DIMS = "(num_blocks, page_size, Hkv, D)"


@dataclass(frozen=True, eq=False)
class PagedKeys:
    """Where the packed keys of a paged call lie in its caches. Packed key t (of ``total_k``, sequence by sequence)
    is row ``offsets[t]`` of block ``blocks[t]``.

    blocks, offsets: (total_k,) int64, read-only.
    shape_k, shape_v: the paged k and v shapes, (num_blocks, page_size, Hkv, D) and (num_blocks, page_size, Hkv, Dv).
    """

    blocks: np.ndarray
    offsets: np.ndarray
    shape_k: tuple[int, ...]
    shape_v: tuple[int, ...]

    def _index(self, x: Any) -> tuple[Any, Any]:
        if array_kind(x) == "torch":
            import torch

            # torch.tensor copies: the index arrays are read-only, which torch.from_numpy warns about
            return tuple(torch.tensor(i, device=x.device) for i in (self.blocks, self.offsets))
        return self.blocks, self.offsets

    def gather(self, x: Any) -> Any:
        """``x`` (num_blocks, page_size, H, D), a numpy array or a torch tensor, as the packed (total_k, H, D) keys
        the call reads: a new contiguous array of x's kind, dtype and device; x is not modified."""
        if array_kind(x) == "torch":
            x = x.detach()
        return x[self._index(x)]

    def scatter(self, grad: Any, shape: tuple[int, ...]) -> Any:
        """The gradient of a paged cache of ``shape`` from ``grad`` (total_k, H, D), the gradient of the packed keys
        ``gather`` made from it: zeros of grad's kind, dtype and device, with each packed key's gradient added at
        the row it came from."""
        if array_kind(grad) == "torch":
            import torch

            paged = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
            return paged.index_put_(self._index(grad), grad, accumulate=True)
        paged = np.zeros(shape, dtype=grad.dtype)
        np.add.at(paged, self._index(grad), grad)
        return paged


def _check_cache(name: str, x: Any) -> tuple[int, ...]:
    kind = array_kind(x)
    if kind not in ("numpy", "torch"):
        got = f"an object of type {type(x).__name__}" if kind is None else f"an array of kind {kind!r}"
        raise bad_arg(name, f"a paged cache {PAGED_DIMS} as a numpy array or a torch tensor with block_table (the "
                      "pages are gathered by their indexing)", got)
    shape = tuple(int(s) for s in x.shape)
    if len(shape) != 4:
        raise bad_arg(name, f"4 dimensions {PAGED_DIMS} with block_table (a paged cache)", f"shape {shape}")
    if 0 in shape[:2]:
        raise bad_arg(name, f"num_blocks >= 1 and page_size >= 1 in {PAGED_DIMS}", f"shape {shape}")
    return shape


def check_paged_keys(k: Any, v: Any, block_table: Any, cu_seqlens_k: Any, layout: str | None = None) -> PagedKeys:
    """The ``PagedKeys`` of a packed call whose k and v are paged caches, or AttentionInputError naming the first
    argument that does not fit: block_table without packed sequences (``layout`` None or "thd" and
    ``cu_seqlens_k`` given), k or v not a paged cache, v's blocks, pages or heads unlike k's, block_table not an
    int32 (B, max_blocks) array, a row with fewer pages than its sequence needs, or a page it uses that is not a
    block of the cache. Only indices are read (on the host); k, v and block_table are never modified.

    k: (num_blocks, page_size, Hkv, D); v: (num_blocks, page_size, Hkv, Dv); block_table: (B, max_blocks) int32
    (int64 accepted), any array kind and device; cu_seqlens_k: (B + 1,) int32 prefix sums of the key counts.
    """
    if cu_seqlens_k is None or layout not in (None, "thd"):
        got = f"layout {layout!r}" if layout not in (None, "thd") else "cu_seqlens_k None"
        raise bad_arg("block_table", "None unless the call is packed (layout 'thd' with cu_seqlens_q and "
                      "cu_seqlens_k; block_table pages its keys)", got)
    shape_k, shape_v = _check_cache("k", k), _check_cache("v", v)
    if shape_v[:3] != shape_k[:3]:
        raise bad_arg("v", f"the blocks, page size and heads of k {shape_k[:3]} (a paged cache {PAGED_DIMS})",
                      f"shape {shape_v}")
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    batch = len(cu_k) - 1
    if array_kind(block_table) is None or len(block_table.shape) != 2:
        got = f"shape {tuple(int(s) for s in block_table.shape)}" if array_kind(block_table) else \
            f"an object of type {type(block_table).__name__}"
        raise bad_arg("block_table", f"an int32 array (B, max_blocks) with B = {batch}", got)
    table = host_ints("block_table", block_table, (batch, int(block_table.shape[1])),
                      f"(B, max_blocks) with B = {batch} (the sequences of cu_seqlens_k)")
    num_blocks, page_size = shape_k[:2]
    seqlens = np.diff(cu_k)
    pages_used = -(-seqlens // page_size)
    short = np.flatnonzero(pages_used > table.shape[1])
    if short.size:
        b = int(short[0])
        raise bad_arg("block_table", f"at least {int(pages_used[b])} pages in row {b} (sequence {b} has "
                      f"{int(seqlens[b])} keys, page_size {page_size})", f"max_blocks = {table.shape[1]} "
                      f"(shape {table.shape})")
    check_block_indices(table, pages_used, num_blocks)
    seq = np.repeat(np.arange(batch), seqlens)
    pos = np.arange(int(cu_k[-1])) - np.repeat(cu_k[:-1], seqlens)   # each key's position in its sequence
    blocks, offsets = table[seq, pos // page_size], pos % page_size
    for a in (blocks, offsets):
        a.flags.writeable = False
    return PagedKeys(blocks, offsets, shape_k, shape_v)


def gather_paged_keys(k: Any, v: Any, block_table: Any, cu_seqlens_k: Any,
                      layout: str | None = None) -> tuple[PagedKeys | None, Any, Any]:
    """``(None, k, v)`` without ``block_table``; else ``(paged, k, v)`` with ``paged = check_paged_keys(...)`` and
    k, v gathered into the packed (total_k, Hkv, D) / (total_k, Hkv, Dv) keys and values the call reads."""
    if block_table is None:
        return None, k, v
    paged = check_paged_keys(k, v, block_table, cu_seqlens_k, layout)
    return paged, paged.gather(k), paged.gather(v)


__all__ = ["PAGED_DIMS", "PagedKeys", "check_paged_keys", "gather_paged_keys"]
