"""The checked mode for mods: run a call's mods on the host over every (b, h, q_idx, kv_idx) of the call, where an
index outside a mod's table and any exception a mod raises are caught and named, before a GPU is trusted with
them (the cuda backend compiles mods without bounds checks: a read past a table's end reads stray memory there).

    numba_flash.check_mods_on_host(q, k, mask_mod=same_doc_causal)       # None, or AttentionInputError

Only the shapes of q and k are read (they may be torch tensors on a GPU: nothing is copied). The mods run through
``mods.evaluate_block``, the evaluation the torch path uses, in chunks of at most ``CHUNK_ELEMENTS`` elements, so
memory stays bounded whatever the call's size; the time is one mod call per element and mod.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from .arguments import checked_arguments
from .errors import AttentionInputError, bad_arg
from .mods import ARGUMENTS, check_mods, evaluate_block

#: The most elements one evaluated block holds: 2**20 float64 values, 8 MiB, whatever the call's size.
CHUNK_ELEMENTS = 1 << 20

# Where the sizes sit in q's and k's shapes, per layout: (batch, heads, sequence).
_AXES = {"bshd": (0, 2, 1), "bhsd": (0, 1, 2)}


def _sizes(name: str, x: Any, layout: str) -> tuple[int, int, int]:
    """(batch, heads, sequence) of array ``name`` in ``layout``, read from its shape alone."""
    shape = getattr(x, "shape", None)
    if shape is None:
        raise bad_arg(name, "an array (only its shape is read)", f"an object of type {type(x).__name__}")
    shape = tuple(int(s) for s in shape)
    dims = "(B, S, H, D)" if layout == "bshd" else "(B, H, S, D)"
    if len(shape) != 4:
        raise bad_arg(name, f"4 dimensions {dims} for layout {layout!r}", f"shape {shape}")
    if 0 in shape:
        raise bad_arg(name, f"every size >= 1 in {dims}", f"shape {shape}")
    b, h, s = _AXES[layout]
    return shape[b], shape[h], shape[s]


def _pieces(n: int, step: int) -> Iterator[range]:
    """``range(n)`` cut into consecutive ranges of at most ``step``."""
    for start in range(0, n, step):
        yield range(start, min(start + step, n))


def _blocks(B: int, H: int, Sq: int, Sk: int, budget: int) -> Iterator[tuple[range, range, range, range]]:
    """(batches, heads, rows, keys) blocks covering the (B, H, Sq, Sk) grid once, each of at most ``budget``
    elements: whole key rows and as many query rows as fit, then heads and batches while whole ones fit (a key row
    longer than the budget is cut too)."""
    nk = min(Sk, budget)
    nq = min(Sq, max(1, budget // nk))
    nh = min(H, max(1, budget // (nk * nq))) if nq == Sq else 1
    nb = min(B, max(1, budget // (nk * nq * nh))) if nh == H else 1
    for batches in _pieces(B, nb):
        for heads in _pieces(H, nh):
            for rows in _pieces(Sq, nq):
                for keys in _pieces(Sk, nk):
                    yield batches, heads, rows, keys


@checked_arguments
def check_mods_on_host(q: Any, k: Any, v: Any = None, *, bias_mod: Callable | None = None,
                       mask_mod: Callable | None = None, score_mod: Callable | None = None,
                       score_mod_grad: Callable | None = None, layout: str = "bshd") -> None:
    """Run each given mod on the host at every (b, h, q_idx, kv_idx) of the call ``q``, ``k`` describe, and raise
    ``AttentionInputError`` naming the first mod that fails, its exception and the element (with its block) where
    it did: an index outside a global array the mod reads, or anything it raises. Returns None when every mod runs
    everywhere. What a GPU cannot tell (the cuda backend reads past a table's end without a word), this can, so
    run it once before trusting a GPU with new mods or new sizes.

    q: (B, Sq, Hq, D) for layout "bshd", (B, Hq, Sq, D) for "bhsd"; k: (B, Sk, Hkv, D) or (B, Hkv, Sk, D). Only
    their shapes are read; ``v`` is accepted, so that a call's arguments can be passed as they are, and not read.
    ``h`` runs over the query heads (Hq), as in the kernels. score_mod and score_mod_grad are given a score of 0
    (their score never decides which table entry they read, or their check would need the call's values).
    Packed sequences (layout "thd") take no mods. Cost: one call per element and mod, in blocks of at most
    ``CHUNK_ELEMENTS`` elements (8 MiB)."""
    if not isinstance(layout, str) or layout not in _AXES:
        raise bad_arg("layout", "'bshd' or 'bhsd' (packed sequences, 'thd', take no mods)", repr(layout))
    B, Hq, Sq = _sizes("q", q, layout)
    kb, _, Sk = _sizes("k", k, layout)
    if kb != B:
        raise bad_arg("k", f"the batch size of q ({B})", kb)
    given = dict(bias_mod=bias_mod, mask_mod=mask_mod, score_mod=score_mod, score_mod_grad=score_mod_grad)
    if all(fn is None for fn in given.values()):
        raise AttentionInputError("bias_mod, mask_mod, score_mod: expected at least one mod to check, got none")
    # the same checks and compiled functions as the call itself (a function numba cannot compile is named there)
    mods = check_mods(*given.values(), None, (B, Hq, Sq, Sk), layout, backward=False)
    zeros = np.zeros(min(CHUNK_ELEMENTS, B * Hq * Sq * Sk))
    for block in _blocks(B, Hq, Sq, Sk, CHUNK_ELEMENTS):
        shape = tuple(len(r) for r in block)
        for name in ARGUMENTS:
            fn = getattr(mods, name)
            if fn is not None:
                scores = zeros[:int(np.prod(shape))].reshape(shape) if name.startswith("score_mod") else None
                evaluate_block(fn, name, *block, scores=scores)


__all__ = ["check_mods_on_host", "CHUNK_ELEMENTS"]
