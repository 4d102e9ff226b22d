"""The user's mods (``numba_flash.mods``: bias_mod, mask_mod, score_mod, score_mod_grad) inside the CPU kernels.

The forward and backward kernels take a last argument, ``hooks``, and reach the mods only through four functions
of this module:

    tile_state(hooks, states, vis, b, h, qt, kt, i0, j0, nq, nk, keys_are_rows) -> EMPTY, PARTIAL or FULL
        before a tile's products: EMPTY skips the tile (the mask_mod hides all of it), PARTIAL fills ``vis``
    mod_scores(hooks, block, vis, grad, state, b, h, i0, j0, nq, nk, keys_are_rows)
        after softcap, ALiBi and attn_bias: bias_mod, score_mod (times score_mod_grad into ``grad``), mask_mod
    mod_zero_hidden(hooks, p, ds, vis, nq, nk, keys_are_rows)
        the backward's P and dS = 0 where a mod hides the pair
    has_mods(hooks): whether any of this is on (every block then counts as masked)

``hooks`` is None for a call without mods: the four are then constants and no-ops inlined into the kernel, which is
the plain kernel and pays nothing. With mods it is a tuple of three compiled functions (numba's first-class
function type, ``workspace.hooks_type``) that ``_make_hooks`` builds around the call's mods, which numba inlines
into them, so a mod costs what its body costs. The kernels are compiled once per dtype for that tuple type and kept
in numba's disk cache like the plain ones: a new mod compiles its three hooks (seconds), not three kernels (about a
minute each on 2 cores), and the kernels run as fast as with the mods inlined into them (BENCHMARKS.md).

numba does not pass an exception through a first-class function: a hook catches what a mod raises and returns
FAILED, the kernel then raises ``ModRaised`` with the tile, and ``mod_errors`` runs the mods over that tile again on
the host to name the exception.

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
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable

import numpy as np
from numba import njit, types
from numba.extending import overload

from .. import compile_notice
from ..errors import AttentionInputError
from ..mods import ARGUMENTS, EMPTY, FULL, PARTIAL, BlockMask, evaluate_block
from .simd import BLOCK_M, BLOCK_N, FASTMATH
from .workspace import hooks_type, kernel_entry

UNKNOWN = 3   # a tile state no pass has evaluated yet (``states_for_call``)
FAILED = -1   # a hook's answer when a mod raised


class ModRaised(Exception):
    """Raised by a kernel when a user's mod raised on a tile; args (b, h, i0, j0, nq, nk), the tile's first query,
    first key and sizes. ``mod_errors`` turns it into the mod's own exception."""


def tile_state(hooks, states, vis, b, h, qt, kt, i0, j0, nq, nk, keys_are_rows):
    """In a kernel: the tile's state (EMPTY, PARTIAL, FULL), FULL without mods (see the module docstring)."""
    raise NotImplementedError("a numba kernel helper")


def mod_scores(hooks, block, vis, grad, state, b, h, i0, j0, nq, nk, keys_are_rows):
    """In a kernel: the mods applied to a block of scores; nothing without mods."""
    raise NotImplementedError("a numba kernel helper")


def mod_zero_hidden(hooks, p, ds, vis, nq, nk, keys_are_rows):
    """In a kernel: P and dS zeroed where the mods hide a pair; nothing without mods."""
    raise NotImplementedError("a numba kernel helper")


def has_mods(hooks):
    """In a kernel: whether the call has mods (a compile-time constant)."""
    raise NotImplementedError("a numba kernel helper")


def _plain(hooks: Any) -> bool:
    return isinstance(hooks, types.NoneType)


@overload(tile_state, inline="always")
def _tile_state_impl(hooks, states, vis, b, h, qt, kt, i0, j0, nq, nk, keys_are_rows):
    if _plain(hooks):
        return lambda hooks, states, vis, b, h, qt, kt, i0, j0, nq, nk, keys_are_rows: FULL

    def call(hooks, states, vis, b, h, qt, kt, i0, j0, nq, nk, keys_are_rows):
        state = hooks[0](states, vis, b, h, qt, kt, i0, j0, nq, nk, keys_are_rows)
        if state == FAILED:
            raise ModRaised(b, h, i0, j0, nq, nk)
        return state
    return call


@overload(mod_scores, inline="always")
def _mod_scores_impl(hooks, block, vis, grad, state, b, h, i0, j0, nq, nk, keys_are_rows):
    if _plain(hooks):
        return lambda hooks, block, vis, grad, state, b, h, i0, j0, nq, nk, keys_are_rows: None

    def call(hooks, block, vis, grad, state, b, h, i0, j0, nq, nk, keys_are_rows):
        if hooks[1](block, vis, grad, state, b, h, i0, j0, nq, nk, keys_are_rows) == FAILED:
            raise ModRaised(b, h, i0, j0, nq, nk)
    return call


@overload(mod_zero_hidden, inline="always")
def _mod_zero_hidden_impl(hooks, p, ds, vis, nq, nk, keys_are_rows):
    if _plain(hooks):
        return lambda hooks, p, ds, vis, nq, nk, keys_are_rows: None
    return lambda hooks, p, ds, vis, nq, nk, keys_are_rows: hooks[2](p, ds, vis, nq, nk, keys_are_rows)


@overload(has_mods, inline="always")
def _has_mods_impl(hooks):
    on = not _plain(hooks)
    return lambda hooks: on


def _make_hooks(bias_mod: Any, mask_mod: Any, score_mod: Any, score_mod_grad: Any, dtype: np.dtype) -> tuple:
    """The hooks for these compiled mods (each a numba dispatcher or None) and ``dtype``: (tile_state, mod_scores,
    zero_hidden), compiled with the argument types of ``workspace.hooks_type``."""
    has_bias, has_mask, has_score = bias_mod is not None, mask_mod is not None, score_mod is not None
    has_grad = score_mod_grad is not None
    # numba types a closure's free variables from their values: stand-ins for the absent mods, never called
    bias_fn = bias_mod if has_bias else _no_index_mod
    mask_fn = mask_mod if has_mask else _no_mask_mod
    score_fn = score_mod if has_score else _no_score_mod
    grad_fn = score_mod_grad if has_grad else _no_score_mod
    tile_state_type, mod_scores_type, _ = hooks_type(dtype).types

    @njit(inline="always")
    def find_state(states, vis, b, h, qt, kt, i0, j0, nq, nk, keys_are_rows):
        if not has_mask:
            return FULL
        known = UNKNOWN
        bs = b if states.shape[0] > 1 else 0
        hs = h if states.shape[1] > 1 else 0
        if states.shape[0] > 0:
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

    @_hook(tile_state_type)
    def tile_state_hook(states, vis, b, h, qt, kt, i0, j0, nq, nk, keys_are_rows):
        state = FAILED
        try:
            state = find_state(states, vis, b, h, qt, kt, i0, j0, nq, nk, keys_are_rows)
        except Exception:   # numba cannot raise through the kernel's call (module docstring)
            state = FAILED
        return state

    @njit(inline="always")
    def apply_mods(block, vis, grad, state, b, h, i0, j0, nq, nk, keys_are_rows):
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

    @_hook(mod_scores_type)
    def mod_scores_hook(block, vis, grad, state, b, h, i0, j0, nq, nk, keys_are_rows):
        status = FAILED
        try:
            apply_mods(block, vis, grad, state, b, h, i0, j0, nq, nk, keys_are_rows)
            status = 0
        except Exception:
            status = FAILED
        return status

    return tile_state_hook, mod_scores_hook, _zero_hidden_hook(dtype)


def _hook(function_type: Any) -> Callable[[Callable], Any]:
    """A decorator compiling a hook now with the argument types of ``function_type`` (one of ``hooks_type``'s).
    The name ends in "[mods]" so that ``compile_notice`` leaves its compilation to our own announcement."""
    def compile_hook(fn: Callable) -> Any:
        fn.__qualname__ = f"{fn.__qualname__}[mods]"
        return njit(function_type.signature, fastmath=FASTMATH)(fn)
    return compile_hook


_zero_hidden_hooks: dict[str, Any] = {}


def _zero_hidden_hook(dtype: np.dtype) -> Any:
    """The backward's zero_hidden hook for ``dtype``, the same for any mods."""
    name = np.dtype(dtype).name
    hook = _zero_hidden_hooks.get(name)
    if hook is None:
        @_hook(hooks_type(dtype).types[2])
        def zero_hidden(p, ds, vis, nq, nk, keys_are_rows):
            n0, n1 = (nk, nq) if keys_are_rows else (nq, nk)
            for a in range(n0):
                for e in range(n1):
                    if not vis[a, e]:
                        p[a, e] = 0
                        ds[a, e] = 0
        hook = _zero_hidden_hooks[name] = zero_hidden
    return hook


@njit
def _no_index_mod(b, h, i, j):
    return 0.0


@njit
def _no_mask_mod(b, h, i, j):
    return True


@njit
def _no_score_mod(s, b, h, i, j):
    return s


_hooks: dict[tuple[Any, ...], tuple] = {}
_hooks_lock = threading.Lock()


def kernel_with_mods(kernel: Any, dtype: np.dtype, mods: Any) -> Callable[..., None]:
    """``kernel`` (a CPU kernel taking ``hooks`` last) compiled for ``dtype``, as a function of the other
    arguments: the plain kernel with hooks None when mods is None, else the kernel's mods variant (compiled once,
    kept in numba's disk cache) with the hooks of ``mods`` (``numba_flash.mods.Mods``), which are compiled once per
    (mods, dtype) in this process."""
    if mods is None:
        plain = kernel_entry(kernel, dtype)
        return lambda *args: plain(*args, None)
    # the forward (also the backward's statistics pass) has no use for score_mod_grad: its hooks serve both
    grad = None if kernel.py_func.__name__ == "forward_kernel" else mods.score_mod_grad
    fns = (mods.bias_mod, mods.mask_mod, mods.score_mod, grad)
    dtype = np.dtype(dtype)
    key = (dtype.name, *fns)
    hooks = _hooks.get(key)
    if hooks is None:
        with _hooks_lock:   # one compilation per key, also when threads call at once
            hooks = _hooks.get(key)
            if hooks is None:
                compile_notice.announce(f"numba-flash: compiling the CPU kernels' hooks for {mods.describe()} "
                                        f"({dtype.name}): a few seconds, once per mod in a process")
                hooks = _hooks[key] = _make_hooks(*fns, dtype)
    with_hooks = kernel_entry(kernel, dtype, hooks=True)
    return lambda *args: with_hooks(*args, hooks)


def _raised_again(mods: Any, tile: tuple[int, ...]) -> BaseException | None:
    """The exception one of ``mods`` raises on ``tile`` ((b, h, i0, j0, nq, nk), ``ModRaised``'s args), run on the
    host; None if none raises there (a score_mod that raised on a score other than 0)."""
    b, h, i0, j0, nq, nk = (int(x) for x in tile)
    where = (range(b, b + 1), range(h, h + 1), range(i0, i0 + nq), range(j0, j0 + nk))
    for name in ARGUMENTS:
        fn = getattr(mods, name)
        if fn is None:
            continue
        try:
            evaluate_block(fn, name, *where, scores=np.zeros((1, 1, nq, nk)))
        except AttentionInputError as exc:
            return exc.__cause__
    return None


@contextmanager
def mod_errors(mods: Any):
    """An exception a user's mod raises inside a kernel (an index out of bounds) as ``AttentionInputError``
    naming the call's mods."""
    if mods is None:
        yield
        return
    try:
        yield
    except (SystemError, ModRaised) as exc:
        raised = exc if not isinstance(exc, SystemError) else (exc.__cause__ or exc.__context__)
        if not isinstance(raised, ModRaised):
            raise
        b, h, i0, j0, nq, nk = raised.args
        where = f"queries {i0}..{i0 + nq - 1} x keys {j0}..{j0 + nk - 1} of b={b} h={h}"
        cause = _raised_again(mods, raised.args)
        what = f"{type(cause).__name__}: {cause}" if cause is not None else "an exception"
        names = [n for n in ARGUMENTS if getattr(mods, n)]
        raise AttentionInputError(
            f"{', '.join(names)}: expected {'a function that runs' if len(names) == 1 else 'functions that run'} on "
            f"every (b, h, q_idx, kv_idx) of the call; inside the CPU kernel, {mods.describe()} raised {what} "
            f"(on {where})") from (cause or raised)


_found: "OrderedDict[tuple[Any, ...], np.ndarray]" = OrderedDict()
_found_lock = threading.Lock()   # not _hooks_lock, which a compilation holds for seconds
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
