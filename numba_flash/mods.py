"""User-written score modifications, FlexAttention's idea without torch.compile: plain Python functions of the
element's indices that numba compiles.

    bias_mod(b, h, q_idx, kv_idx) -> float           added to the score (after softcap, with attn_bias and ALiBi)
    mask_mod(b, h, q_idx, kv_idx) -> bool            False hides the key from that query row
    score_mod(score, b, h, q_idx, kv_idx) -> float   any change of the (biased) score
    score_mod_grad(score, b, h, q_idx, kv_idx) -> float   d score_mod / d score, which the backward needs

``b`` is the batch index, ``h`` the query head, ``q_idx`` and ``kv_idx`` the positions in the sequences (int64);
``score`` is float64 (float32 in the CUDA kernels, numba_flash/cuda/device/user_mods.py, which build each mod for the GPU
from its Python source). A mod may read global numpy arrays (document ids, a per-head table) and call other
``numba.njit`` functions. numba freezes a function's global arrays when it compiles it, and compiled mods are kept
per function object: to change a table, build a new function (a factory that returns a closure), do not edit the
array in place. Mods are compiled with numpy's error model (1 / 0 is inf, which then poisons its row as any
non-finite score does) and with bounds checks: an index outside a global array raises ``AttentionInputError``
naming the mod instead of reading stray memory. Any other exception a mod raises on the host (a RuntimeError, a
failed ``assert``, a KeyError) becomes ``AttentionInputError`` too, naming the mod, its exception and where it
raised: the tile in the CPU kernels and ``block_mask``, the element and its block on the torch path
(``evaluate_block``).

On a real GPU (the cuda backend) a mod is compiled for the device without bounds checks, as numba-cuda compiles
every kernel: a table read past its end reads whatever memory lies there (or faults the context with an illegal
address), and a ``raise`` in a mod cannot reach the host as that exception. Nothing names the mod there. To check a
mod, run ``numba_flash.check_mods_on_host(q, k, mask_mod=...)`` (``mod_check``: the checked mode, which runs the
mods on the host over every element of the call, in bounded chunks, reading only q's and k's shapes) or the same
call once on the cpu backend (``backend="cpu"``): both raise by name.

``compile_mod`` checks a mod once (``AttentionInputError`` naming the argument and numba's reason when numba cannot
compile it), ``evaluate_block`` evaluates one over a block of indices, and ``block_mask`` precomputes which tiles a
mask_mod hides entirely (skipped), shows entirely (run without per-element mask work) or partly, as FlexAttention's
``create_block_mask`` does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from numba import njit, types

from .errors import AttentionInputError

EMPTY, PARTIAL, FULL = 0, 1, 2  # tile states in a BlockMask

_INDEX = (types.int64,) * 4
SIGNATURES = {
    "bias_mod": types.float64(*_INDEX),
    "mask_mod": types.boolean(*_INDEX),
    "score_mod": types.float64(types.float64, *_INDEX),
    "score_mod_grad": types.float64(types.float64, *_INDEX),
}
ARGUMENTS = {"bias_mod": "(b, h, q_idx, kv_idx) -> float", "mask_mod": "(b, h, q_idx, kv_idx) -> bool",
             "score_mod": "(score, b, h, q_idx, kv_idx) -> float",
             "score_mod_grad": "(score, b, h, q_idx, kv_idx) -> float"}

_compiled: dict[tuple[Any, str], Any] = {}
_lock = threading.Lock()


def compile_mod(fn: Any, name: str) -> Any:
    """``fn`` compiled by numba for the role ``name`` ("bias_mod", "mask_mod", "score_mod" or "score_mod_grad"):
    a ``numba.njit`` dispatcher with the role's signature. Compiled once per function object (a function already
    decorated with ``numba.njit`` is used as it is). ``AttentionInputError`` names the argument and gives numba's
    reason when ``fn`` is not callable or numba cannot compile it."""
    if not callable(fn):
        raise AttentionInputError(f"{name}: expected a function {ARGUMENTS[name]}, got {type(fn).__name__}")
    key = (fn, name)
    with _lock:
        hit = _compiled.get(key)
    if hit is not None:
        return hit
    from numba.core.registry import CPUDispatcher

    label = getattr(fn, "__qualname__", None) or repr(fn)
    try:
        disp = fn if isinstance(fn, CPUDispatcher) else njit(fn, boundscheck=True, error_model="numpy")
        disp.compile(SIGNATURES[name])
    except Exception as exc:  # numba raises TypingError, UnsupportedError, NotImplementedError, ...
        reason = str(exc).strip().splitlines()
        short = " ".join(line.strip() for line in reason[:6] if line.strip())
        raise AttentionInputError(
            f"{name}: expected a function {ARGUMENTS[name]} that numba can compile; numba could not compile "
            f"{label}: {type(exc).__name__}: {short}") from exc
    _check_returns(disp, name, label)
    with _lock:
        _compiled[key] = disp
    return disp


def _check_returns(disp: Any, name: str, label: str) -> None:
    """``AttentionInputError`` unless ``disp`` returns a number or a bool as numba inferred it (the role's
    signature casts it, so a body that only raises compiles there and fails later, inside a kernel's). The overload
    ``compile_mod`` made keeps the inferred type in its signature, whatever return type the role's signature gave."""
    returned = disp.overloads[SIGNATURES[name].args].signature.return_type
    if not isinstance(returned, (types.Number, types.Boolean)):
        what = "nothing (its body only raises, or has no return)" if returned == types.none else str(returned)
        raise AttentionInputError(f"{name}: expected a function {ARGUMENTS[name]}; {label} returns {what}")


# The evaluation loops are serial: an exception raised inside a numba prange loop (a mod's IndexError) does not
# reach the caller intact, and a plain loop reports it as it is. ``at[0]`` is the flat index of the element being
# evaluated, so that an error can name it (a store per element, against a mod call per element).
@njit
def _index_block(fn, out, b0, h0, q0, k0, at):
    nb, nh, nq, nk = out.shape
    for t in range(nb * nh * nq):
        b, h, i = t // (nh * nq), (t // nq) % nh, t % nq
        for j in range(nk):
            at[0] = t * nk + j
            out[b, h, i, j] = fn(b0 + b, h0 + h, q0 + i, k0 + j)


@njit
def _score_block(fn, scores, out, b0, h0, q0, k0, at):
    nb, nh, nq, nk = out.shape
    for t in range(nb * nh * nq):
        b, h, i = t // (nh * nq), (t // nq) % nh, t % nq
        for j in range(nk):
            at[0] = t * nk + j
            out[b, h, i, j] = fn(scores[b, h, i, j], b0 + b, h0 + h, q0 + i, k0 + j)


def _span(r: range) -> str:
    return f"{r.start}..{r.stop - 1}"


def evaluate_block(fn: Any, name: str, batches: range, heads: range, rows: range, keys: range,
                   scores: np.ndarray | None = None) -> np.ndarray:
    """A compiled mod (``compile_mod``) at every (b, h, q_idx, kv_idx) of the block: (len(batches), len(heads),
    len(rows), len(keys)), float64 (bool for a mask_mod). The index ranges have step 1. score_mod and
    score_mod_grad take ``scores``, float64 of that shape, as their first argument."""
    shape = (len(batches), len(heads), len(rows), len(keys))
    out = np.empty(shape, dtype=np.bool_ if name == "mask_mod" else np.float64)
    if 0 in shape:
        return out
    starts = (batches.start, heads.start, rows.start, keys.start)
    at = np.zeros(1, np.int64)
    try:
        if name in ("score_mod", "score_mod_grad"):
            _score_block(fn, np.ascontiguousarray(scores, dtype=np.float64), out, *starts, at)
        else:
            _index_block(fn, out, *starts, at)
    except Exception as exc:
        b, h, i, j = (int(x) + s0 for x, s0 in zip(np.unravel_index(int(at[0]), shape), starts))
        raise mod_error(name, fn, exc, f"at b={b}, h={h}, q_idx={i}, kv_idx={j}, in the block of queries "
                                       f"{_span(rows)} x keys {_span(keys)}, b {_span(batches)}, h {_span(heads)}"
                        ) from exc
    return out


def mod_error(name: str, fn: Any, exc: BaseException, where: str = "") -> AttentionInputError:
    """The error for ``exc``, raised by the user's mod ``fn`` in the role ``name`` while it ran (an index out of
    bounds, a RuntimeError, a failed assert): whatever the mod's own error, the call's input (the mod) is at fault.
    ``where``: the element or tile it ran on, when the caller knows it. Every path that runs mods (the CPU kernels,
    the torch path, ``block_mask``, the CUDA simulator's launches) words it so."""
    label = getattr(fn, "__name__", repr(fn))
    return AttentionInputError(f"{name}: expected a function that runs on every (b, h, q_idx, kv_idx) of the call; "
                               f"{label} raised {type(exc).__name__}: {exc}" + (f" ({where})" if where else ""))


@njit
def _tile_states(fn, states, seqlen_q, seqlen_k, block_m, block_n):
    nb, nh, nqt, nkt = states.shape
    for t in range(nb * nh * nqt):
        b, h, qt = t // (nh * nqt), (t // nqt) % nh, t % nqt
        q0 = qt * block_m
        q1 = min(q0 + block_m, seqlen_q)
        for kt in range(nkt):
            k0 = kt * block_n
            k1 = min(k0 + block_n, seqlen_k)
            seen = 0
            for i in range(q0, q1):
                for j in range(k0, k1):
                    if fn(b, h, i, j):
                        seen += 1
            total = (q1 - q0) * (k1 - k0)
            states[b, h, qt, kt] = 0 if seen == 0 else (2 if seen == total else 1)


@dataclass(frozen=True)
class BlockMask:
    """Which (block_m x block_n) tiles of each (b, h) score matrix a mask_mod hides: ``states`` int8
    (B, H, ceil(Sq / block_m), ceil(Sk / block_n)) of EMPTY (0: every key hidden, the tile is skipped), PARTIAL (1)
    or FULL (2: every key visible, no per-element mask work). B or H of 1 means the mask does not depend on it
    (it was evaluated at b = 0 or h = 0) and serves every batch or head."""

    mask_mod: Callable
    states: np.ndarray
    seqlen_q: int
    seqlen_k: int
    block_m: int
    block_n: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, H, Sq, Sk) the mask was built for."""
        return (self.states.shape[0], self.states.shape[1], self.seqlen_q, self.seqlen_k)

    def visible_fraction(self) -> float:
        """The share of tiles that are not skipped (FULL or PARTIAL), what the kernels' cost follows."""
        return float((self.states != EMPTY).mean())

    def tile(self, b: int, h: int, i: int, j: int) -> int:
        """The state of the tile holding score (i, j) of batch b, query head h (broadcast over B or H of 1)."""
        nb, nh = self.states.shape[:2]
        return int(self.states[b if nb > 1 else 0, h if nh > 1 else 0, i // self.block_m, j // self.block_n])

    def plot(self, b: int = 0, h: int = 0, ax: Any = None) -> Any:
        """The tile states of batch b, head h as an image (query tiles down, key tiles across; white skipped, grey
        partial, black full) in ``ax``, or a new bare matplotlib Figure (never pyplot's, so a notebook's own
        figures are left alone); returns the figure. In a notebook, ``mask.plot()`` shows it."""
        from matplotlib.colors import ListedColormap

        if ax is None:
            from matplotlib.figure import Figure

            fig = Figure(figsize=(5, 5 * self.states.shape[2] / max(self.states.shape[3], 1) + 0.6))
            ax = fig.add_subplot()
        else:
            fig = ax.figure
        nb, nh = self.states.shape[:2]
        tiles = self.states[b if nb > 1 else 0, h if nh > 1 else 0]
        ax.imshow(tiles, cmap=ListedColormap(["white", "0.6", "black"]), vmin=EMPTY, vmax=FULL,
                  interpolation="nearest", aspect="auto")
        name = getattr(self.mask_mod, "__name__", "mask_mod")
        ax.set_title(f"{name}: b={b} h={h}, {self.block_m}x{self.block_n} tiles, "
                     f"{self.visible_fraction():.1%} run", fontsize=9)
        ax.set_xlabel(f"key tile (Sk = {self.seqlen_k})")
        ax.set_ylabel(f"query tile (Sq = {self.seqlen_q})")
        return fig

    def _repr_png_(self) -> bytes | None:
        """The plot, for notebooks that display objects as images; None (text repr) without matplotlib."""
        try:
            import io

            buf = io.BytesIO()
            self.plot().savefig(buf, format="png", dpi=80)
            return buf.getvalue()
        except ImportError:
            return None

    def __repr__(self) -> str:
        counts = [int((self.states == s).sum()) for s in (EMPTY, PARTIAL, FULL)]
        return (f"BlockMask(shape={self.shape}, block=({self.block_m}, {self.block_n}), tiles: {counts[0]} empty, "
                f"{counts[1]} partial, {counts[2]} full; {self.visible_fraction():.1%} of tiles run)")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise AttentionInputError(f"{name}: expected an int >= 1, got {value!r}")
    return int(value)


def block_mask(mask_mod: Callable, B: int, H: int, Sq: int, Sk: int, block_m: int = 64,
               block_n: int = 64) -> BlockMask:
    """Evaluate ``mask_mod(b, h, q_idx, kv_idx)`` once over the whole (B, H, Sq, Sk) grid and record, per tile,
    whether it hides every key, shows every key or some. Pass B = 1 or H = 1 when the mask does not depend on the
    batch or the head (evaluated at 0, it then serves all). Cost: one mask_mod call per element; the
    result is (B, H, ceil(Sq / block_m), ceil(Sk / block_n)) bytes, reusable across calls and layers."""
    dims = [_positive_int(n, v) for n, v in (("B", B), ("H", H), ("Sq", Sq), ("Sk", Sk), ("block_m", block_m),
                                             ("block_n", block_n))]
    b, h, sq, sk, bm, bn = dims
    fn = compile_mod(mask_mod, "mask_mod")
    # -1 until a tile is classified: the loop runs in order, so after an exception the first -1 is where it raised
    states = np.full((b, h, -(-sq // bm), -(-sk // bn)), -1, dtype=np.int8)
    try:
        _tile_states(fn, states, sq, sk, bm, bn)
    except Exception as exc:
        tb, th, qt, kt = (int(x) for x in np.argwhere(states < 0)[0])
        rows, keys = range(qt * bm, min(qt * bm + bm, sq)), range(kt * bn, min(kt * bn + bn, sk))
        raise mod_error("mask_mod", mask_mod, exc,
                        f"in the tile of queries {_span(rows)} x keys {_span(keys)} of b={tb}, h={th}") from exc
    return BlockMask(mask_mod, states, sq, sk, bm, bn)


@dataclass(frozen=True)
class Mods:
    """A call's validated mods, each compiled (``compile_mod``) or None, and the BlockMask of its mask_mod (the
    caller's, or None when it gave none)."""

    bias_mod: Any = None
    mask_mod: Any = None
    score_mod: Any = None
    score_mod_grad: Any = None
    block_mask: BlockMask | None = None

    def describe(self) -> str:
        names = [f"{n}={getattr(getattr(self, n), '__name__', '?')}" for n in ARGUMENTS if getattr(self, n)]
        return " ".join(names + (["block_mask"] if self.block_mask is not None else []))


def check_mods(bias_mod: Any, mask_mod: Any, score_mod: Any, score_mod_grad: Any, block_mask: Any,
               full: tuple[int, int, int, int], layout: str, backward: bool) -> Mods | None:
    """The call's mods as ``Mods`` (each compiled once per function), or None when it has none;
    ``AttentionInputError`` naming the argument otherwise. ``full`` = (B, Hq, Sq, Sk). The backward of a
    score_mod needs its score_mod_grad; a block_mask must come from this mask_mod, for these sizes."""
    given = dict(bias_mod=bias_mod, mask_mod=mask_mod, score_mod=score_mod, score_mod_grad=score_mod_grad)
    if all(f is None for f in given.values()) and block_mask is None:
        return None
    if layout == "thd":
        name = next(n for n, f in [*given.items(), ("block_mask", block_mask)] if f is not None)
        raise AttentionInputError(f"{name}: expected None for packed sequences (mods with layout 'thd' are not "
                                  "implemented yet)")
    if backward and score_mod is not None and score_mod_grad is None:
        raise AttentionInputError("score_mod_grad: expected d score_mod / d score, a function (score, b, h, q_idx, "
                                  "kv_idx) -> float, for the backward of score_mod, got None")
    if score_mod_grad is not None and score_mod is None:
        raise AttentionInputError("score_mod_grad: expected None without a score_mod (it is score_mod's "
                                  "derivative)")
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise AttentionInputError(f"block_mask: expected a numba_flash.BlockMask (numba_flash.block_mask("
                                      f"mask_mod, B, H, Sq, Sk)), got {type(block_mask).__name__}")
        if block_mask.mask_mod is not mask_mod:
            raise AttentionInputError("block_mask: expected the BlockMask of this call's mask_mod, got one built "
                                      f"from {getattr(block_mask.mask_mod, '__name__', block_mask.mask_mod)!r}")
        b, h, sq, sk = block_mask.shape
        if b not in (1, full[0]) or h not in (1, full[1]) or (sq, sk) != full[2:]:
            raise AttentionInputError(f"block_mask: expected one built for (B, H, Sq, Sk) = {full} (B or H may be 1), "
                                      f"got {block_mask.shape}")
    compiled = {n: None if f is None else compile_mod(f, n) for n, f in given.items()}
    return Mods(**compiled, block_mask=block_mask)


__all__ = ["BlockMask", "block_mask", "compile_mod", "evaluate_block", "check_mods", "mod_error", "Mods", "EMPTY", "PARTIAL",
           "FULL"]
