"""The user's mods (``numba_flash.mods``: bias_mod, mask_mod, score_mod, score_mod_grad) inside the CPU kernels.

The forward and backward kernels call three hooks, and test one flag, that are module globals of theirs:

    _tile_state(states, vis, b, h, qt, kt, i0, j0, nq, nk, keys_are_rows) -> EMPTY, PARTIAL or FULL
        before a tile's products: EMPTY skips the tile (the mask_mod hides all of it), PARTIAL fills ``vis``
    _mod_scores(block, vis, grad, state, b, h, i0, j0, nq, nk, keys_are_rows)
        after softcap, ALiBi and attn_bias: bias_mod, score_mod (times score_mod_grad into ``grad``), mask_mod
    _mod_zero_hidden(p, ds, vis, nq, nk, keys_are_rows)
        the backward's P and dS = 0 where a mod hides the pair
    _MODS: whether any of this is on (every block then counts as masked)

The versions here do nothing and are what the cached kernels compile with, so a call without mods pays nothing.
``kernel_with_mods`` compiles the same kernel source again, and the worker its parallel loop calls, with these
globals replaced by hooks built around the call's compiled mods (``_make_hooks``), which numba inlines: a mod costs
what its body costs. Those kernels are kept per (kernel, mods, dtype) for the life of the process; numba cannot
cache them on disk (a user function is part of the code), so the first call with a new mod compiles for about a
minute per kernel on 2 cores (``_forward_worker`` says where the time goes).

Blocks are (keys x queries) when ``keys_are_rows`` (the forward and the dQ pass) and (queries x keys) otherwise;
``vis`` has the block's layout and says which pairs the mods leave visible; the loops cover the nq real queries
and nk real keys only, so a mod is never called with an index past Sq or Sk. ``states``: the call's BlockMask
mapped onto the kernels' tiles (``kernel_tile_states``); without one, what earlier passes found
(``states_for_call``): the first visit of a tile evaluates the mask_mod over it and records whether it hid all,
some or none of it, so the backward and later calls of the same sizes skip empty tiles and run full ones without
evaluating the mask.
"""

from __future__ import annotations

import threading
import types as pytypes
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any

import numpy as np
from numba import njit

from .. import compile_notice
from ..errors import AttentionInputError
from ..mods import EMPTY, FULL, PARTIAL, BlockMask
from .simd import BLOCK_M, BLOCK_N
from .workspace import _entry, _signature

_MODS = False
UNKNOWN = 3   # a tile state no pass has evaluated yet (``states_for_call``)


@njit(inline="always", cache=True)
def _tile_state(states, vis, b, h, qt, kt, i0, j0, nq, nk, keys_are_rows):
    return FULL


@njit(inline="always", cache=True)
def _mod_scores(block, vis, grad, state, b, h, i0, j0, nq, nk, keys_are_rows):
    return


@njit(inline="always", cache=True)
def _mod_zero_hidden(p, ds, vis, nq, nk, keys_are_rows):
    return


def _make_hooks(bias_mod: Any, mask_mod: Any, score_mod: Any, score_mod_grad: Any) -> dict[str, Any]:
    """The hooks for these compiled mods (each a numba dispatcher or None), as the globals to swap in."""
    has_bias, has_mask, has_score = bias_mod is not None, mask_mod is not None, score_mod is not None
    has_grad = score_mod_grad is not None
    # numba types a closure's free variables from their values: stand-ins for the absent mods, never called
    bias_fn = bias_mod if has_bias else _no_index_mod
    mask_fn = mask_mod if has_mask else _no_mask_mod
    score_fn = score_mod if has_score else _no_score_mod
    grad_fn = score_mod_grad if has_grad else _no_score_mod

    @njit(inline="always")
    def tile_state(states, vis, b, h, qt, kt, i0, j0, nq, nk, keys_are_rows):
        if not has_mask:
            return FULL
        known = UNKNOWN
        if states.shape[0] > 0:
            bs = b if states.shape[0] > 1 else 0
            hs = h if states.shape[1] > 1 else 0
            known = states[bs, hs, qt, kt]
            if known != PARTIAL and known != UNKNOWN:
                return known
        seen = 0
        n0, n1 = (nk, nq) if keys_are_rows else (nq, nk)
        for a in range(n0):       # along the block's rows, contiguous
            for e in range(n1):
                i, j = (i0 + e, j0 + a) if keys_are_rows else (i0 + a, j0 + e)
                m = mask_fn(b, h, i, j)
                vis[a, e] = m
                seen += m
        state = EMPTY if seen == 0 else (FULL if seen == nq * nk else PARTIAL)
        if known == UNKNOWN and states.shape[0] > 0:
            states[bs, hs, qt, kt] = state   # this call's later passes, and later calls, know it
        return state

    @njit(inline="always")
    def mod_scores(block, vis, grad, state, b, h, i0, j0, nq, nk, keys_are_rows):
        neg_inf = -np.inf
        n0, n1 = (nk, nq) if keys_are_rows else (nq, nk)
        if not (has_bias or has_score):   # the mask alone: hide what it hides
            for a in range(n0):
                for e in range(n1):
                    if state == FULL:
                        vis[a, e] = True
                    elif not vis[a, e]:
                        block[a, e] = neg_inf
            return
        # selects, not branches, so that LLVM can vectorise the loop around a simple mod; the mods run on every
        # pair of the block (as the reference's do), score_mod on 0 where the score is not finite
        for a in range(n0):
            for e in range(n1):
                i, j = (i0 + e, j0 + a) if keys_are_rows else (i0 + a, j0 + e)
                x = np.float64(block[a, e])
                hidden = x == neg_inf
                if state != FULL:
                    hidden = hidden | (not vis[a, e])
                if has_bias:
                    extra = bias_fn(b, h, i, j)
                    hidden = hidden | (extra == neg_inf)
                    x = x + extra
                if has_score:
                    finite = abs(x) < np.inf
                    x_in = x if finite else 0.0
                    y = score_fn(x_in, b, h, i, j)
                    if has_grad and grad.shape[0] > 1:
                        g = grad_fn(x_in, b, h, i, j)
                        grad[a, e] *= g if finite else 1.0
                    hidden = hidden | (finite & (y == neg_inf))   # a -inf score hides the pair as a mask does
                    x = y if finite else x
                x = x if abs(x) < np.inf else np.nan   # poisons the row, as any visible score that is not finite
                block[a, e] = neg_inf if hidden else x
                vis[a, e] = not hidden

    @njit(inline="always")
    def mod_zero_hidden(p, ds, vis, nq, nk, keys_are_rows):
        n0, n1 = (nk, nq) if keys_are_rows else (nq, nk)
        for a in range(n0):
            for e in range(n1):
                if not vis[a, e]:
                    p[a, e] = 0
                    ds[a, e] = 0

    return {"_MODS": True, "_tile_state": tile_state, "_mod_scores": mod_scores,
            "_mod_zero_hidden": mod_zero_hidden}


@njit
def _no_index_mod(b, h, i, j):
    return 0.0


@njit
def _no_mask_mod(b, h, i, j):
    return True


@njit
def _no_score_mod(s, b, h, i, j):
    return s


_kernels: dict[tuple[Any, ...], Any] = {}
_kernels_lock = threading.Lock()


def _variant(dispatcher: Any, scope: dict[str, Any]) -> Any:
    """A new numba dispatcher for ``dispatcher``'s Python source with ``scope`` as its globals and its options,
    less numba's disk cache."""
    py = dispatcher.py_func
    fn = pytypes.FunctionType(py.__code__, scope, py.__name__, py.__defaults__, py.__closure__)
    fn.__qualname__ = f"{py.__qualname__}[mods]"
    return njit(**{n: v for n, v in dispatcher.targetoptions.items() if n not in ("cache", "nopython")})(fn)


def kernel_with_mods(kernel: Any, dtype: np.dtype, mods: Any) -> Any:
    """``kernel`` (a cached CPU kernel) compiled for ``dtype`` with the hooks of ``mods``
    (``numba_flash.mods.Mods``); the plain compiled kernel (``workspace._entry``) when mods is None. Compiled once
    per (kernel, mods, dtype) in this process."""
    if mods is None:
        return _entry(kernel, dtype)
    # the forward (also the backward's statistics pass) has no use for score_mod_grad: one kernel serves both
    grad = None if kernel.py_func.__name__ == "_forward_kernel" else mods.score_mod_grad
    fns = (mods.bias_mod, mods.mask_mod, mods.score_mod, grad)
    dtype = np.dtype(dtype)
    key = (kernel, dtype.name, *fns)
    fn = _kernels.get(key)
    if fn is not None:
        return fn
    with _kernels_lock:   # one compilation per key, also when threads call at once
        fn = _kernels.get(key)
        if fn is None:
            py = kernel.py_func
            scope = dict(py.__globals__)
            scope.update(_make_hooks(*fns))
            # the kernel's prange calls its worker (``_forward_kernel`` -> ``_forward_worker``), where the hooks are
            worker = py.__name__.replace("_kernel", "_worker")
            scope[worker] = _variant(scope[worker], scope)
            compile_notice.announce(f"numba-flash: compiling {py.__name__} for {mods.describe()} ({dtype.name}): "
                                    "about 1 min on 2 cores, once per mod in a process (numba cannot cache "
                                    "kernels built around user functions on disk)")
            fn = _kernels[key] = _variant(kernel, scope).compile(_signature(py.__name__, dtype))
    return fn


@contextmanager
def mod_errors(mods: Any):
    """An exception a user's mod raises inside a kernel (an index out of bounds; numba's parallel loop hands it
    over as a SystemError caused by it) as ``AttentionInputError`` naming the call's mods."""
    if mods is None:
        yield
        return
    try:
        yield
    except (SystemError, IndexError, ValueError, ArithmeticError) as exc:
        cause = exc if not isinstance(exc, SystemError) else (exc.__cause__ or exc.__context__)
        if cause is None:
            raise
        names = [n for n in ("bias_mod", "mask_mod", "score_mod", "score_mod_grad") if getattr(mods, n)]
        raise AttentionInputError(
            f"{', '.join(names)}: expected {'a function that runs' if len(names) == 1 else 'functions that run'} on "
            f"every (b, h, q_idx, kv_idx) of the call; inside the CPU kernel, {mods.describe()} raised "
            f"{type(cause).__name__}: {cause}") from cause


_found: "OrderedDict[tuple[Any, ...], np.ndarray]" = OrderedDict()
_found_lock = threading.Lock()   # not _kernels_lock, which a compilation holds for a minute
_FOUND_KEPT = 32


def states_for_call(mods: Any, batch: int, nheads_q: int, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """The kernels' ``tile_states`` argument for a call: (0, 0, 0, 0) without a mask_mod; the call's BlockMask on
    the kernels' tiles (``kernel_tile_states``); else the states the kernels found for this mask_mod and these
    sizes in earlier passes, int8 (B, Hq, n_qt, n_kt), UNKNOWN where none has looked yet (a tile's first visit
    evaluates the mask and writes its state). A mask_mod's tables are frozen when numba compiles it, so its states
    cannot change; the last ``_FOUND_KEPT`` (mask_mod, sizes) are kept, B * Hq * n_qt * n_kt bytes each."""
    if mods is None or mods.mask_mod is None:
        return _NO_STATES
    if mods.block_mask is not None:
        return kernel_tile_states(mods.block_mask, seqlen_q, seqlen_k)
    key = (mods.mask_mod, batch, nheads_q, seqlen_q, seqlen_k)
    with _found_lock:
        found = _found.get(key)
        if found is None:
            shape = (batch, nheads_q, -(-seqlen_q // BLOCK_M), -(-seqlen_k // BLOCK_N))
            found = _found[key] = np.full(shape, UNKNOWN, np.int8)
            while len(_found) > _FOUND_KEPT:
                _found.popitem(last=False)
        _found.move_to_end(key)
    return found


_NO_STATES = np.zeros((0, 0, 0, 0), np.int8)


def kernel_tile_states(block_mask: BlockMask | None, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """A BlockMask's states on the kernels' (BLOCK_M x BLOCK_N) tiles, int8 (B or 1, H or 1, n_qt, n_kt): EMPTY
    where every tile of the mask that overlaps the kernel tile is, FULL likewise, PARTIAL otherwise (so any tile
    sizes map, aligned or not); a (0, 0, 0, 0) array without a mask."""
    if block_mask is None:
        return _NO_STATES
    states = block_mask.states

    def spans(n: int, kernel_block: int, mask_block: int) -> list[slice]:
        return [slice(t // mask_block, (min(t + kernel_block, n) - 1) // mask_block + 1)
                for t in range(0, n, kernel_block)]

    rows, cols = spans(seqlen_q, BLOCK_M, block_mask.block_m), spans(seqlen_k, BLOCK_N, block_mask.block_n)
    lo = np.stack([states[:, :, s].min(axis=2) for s in rows], axis=2)
    hi = np.stack([states[:, :, s].max(axis=2) for s in rows], axis=2)
    lo = np.stack([lo[:, :, :, s].min(axis=3) for s in cols], axis=3)
    hi = np.stack([hi[:, :, :, s].max(axis=3) for s in cols], axis=3)
    out = np.full(lo.shape, PARTIAL, np.int8)
    out[hi == EMPTY] = EMPTY
    out[lo == FULL] = FULL
    return out
