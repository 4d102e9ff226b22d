"""The user's mods (``numba_flash.mods``: bias_mod, mask_mod, score_mod and score_mod_grad) as CUDA device
functions, and the helpers every kernel calls them through.

A mod is the user's plain Python function, compiled by numba-cuda from its source (``py_func`` of the njit
dispatcher ``compile_mod`` made) as a device function of its own, which NVVM then inlines (``forceinline``). Not
numba's ``inline="always"``: that splices the mod's code into each call site before lowering, and numba lowers a
global numpy array the mod reads (a document-id table) into a new constant-memory copy per site, where the GPU has
64 KiB of constant memory in all. A device function of its own holds one copy per read of the table in its source.

Indices reach the mods as int64 (as on the CPU); the score as float32 in natural units (the kernels' scores are in
log2 units and converted on the way in and out), where the CPU and the reference pass float64. Kernel factories
are keyed on ``CudaMods``, so each set of mods compiles once per process and kernel specialisation.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, replace
from typing import Any

from numba import config, cuda, float32, int64

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MOD_NAMES = ("bias_mod", "mask_mod", "score_mod", "score_mod_grad")
#: How a mod compiles: a device function of its own that NVVM inlines, with approximate division and math
#: functions (CUDA's fast variants, about 2 ulp). IEEE division and libdevice's exact functions take a subroutine
#: call per score on their slow paths, around which the tensor-core forward spills on sm_80 (measured with a tanh
#: score_mod: 255 registers and 128 B of spills, against 167 and none). Not the flags that assume no inf or NaN:
#: a mod's -inf hides a key.
DEVICE_OPTIONS = {"forceinline": True, "fastmath": {"arcp", "contract", "afn"}}


@dataclass(frozen=True)
class CudaMods:
    """A call's mods as CUDA device functions (``cuda_mods``), each None when absent. ``block_tiles``: the kernels
    read a table of which tiles mask_mod hides entirely (skipped) or shows entirely (run without mask_mod), the
    caller's BlockMask re-cut to their tiles (block_tiles.py); set by launch.py when the call has a BlockMask."""

    bias_mod: Any = None
    mask_mod: Any = None
    score_mod: Any = None
    score_mod_grad: Any = None
    block_tiles: bool = False

    @property
    def any(self) -> bool:
        return any(getattr(self, n) is not None for n in MOD_NAMES)

    @property
    def stages_tile(self) -> bool:
        """Whether the SIMT kernels take mods through their staged bias tile (``masks.make_bias_tile``): bias_mod
        and mask_mod do not depend on the score, so they are evaluated once per pair there."""
        return self.bias_mod is not None or self.mask_mod is not None


NO_MODS = CudaMods()


def without_mask_mod(mods: CudaMods) -> CudaMods:
    """``mods`` less mask_mod (and the table): what the kernels evaluate on a tile the table calls FULL."""
    return replace(mods, mask_mod=None, block_tiles=False)


_device_functions: dict[Any, Any] = {}
_lock = threading.Lock()


def cuda_mods(mods: Any) -> CudaMods:
    """``CudaMods`` of a call's ``numba_flash.mods.Mods`` (or None: ``NO_MODS``), each mod made a device function
    once per Python function. Compiled lazily, with the kernel that calls it: a mod numba-cuda cannot compile fails
    there (``launch.py`` names it)."""
    if mods is None:
        return NO_MODS
    found = {}
    for name in MOD_NAMES:
        fn = getattr(mods, name)
        if fn is None:
            continue
        py = getattr(fn, "py_func", fn)
        with _lock:
            dev = _device_functions.get(py)
            if dev is None:
                options = {} if config.ENABLE_CUDASIM else DEVICE_OPTIONS   # the simulator has no NVVM
                dev = _device_functions[py] = cuda.jit(device=True, **options)(py)
        found[name] = dev
    return CudaMods(**found)


@functools.lru_cache(maxsize=None)
def make_index_terms(mods: CudaMods) -> Any:
    """``index_terms(b, h, row, col) -> (extra, hidden)``: the terms that depend on the indices only: bias_mod's
    value in natural units (0 without one) and whether mask_mod hides the pair (False without one). For indices
    inside the sequences. Kept apart because a hidden pair is hidden whatever the bias (+inf included)."""
    MASK_MOD, BIAS_MOD = mods.mask_mod, mods.bias_mod
    HAS_MASK, HAS_BIAS_MOD = MASK_MOD is not None, BIAS_MOD is not None

    @cuda.jit(device=True, inline="always")
    def index_terms(b, h, row, col):
        extra = float32(0.0)
        hidden = False
        if HAS_BIAS_MOD:
            extra = float32(BIAS_MOD(int64(b), int64(h), int64(row), int64(col)))
        if HAS_MASK:
            hidden = not MASK_MOD(int64(b), int64(h), int64(row), int64(col))
        return extra, hidden

    return index_terms


@functools.lru_cache(maxsize=None)
def make_tile_index_terms(mods: CudaMods) -> Any:
    """``index_terms(b, h, row, col, check_mask) -> (extra, hidden)``: ``make_index_terms``'s, except that with
    ``mods.block_tiles`` mask_mod runs only where ``check_mask`` (False on a tile the BlockMask's table calls FULL,
    where it shows every pair: a uniform branch, each mod's code once); without, ``check_mask`` is not read."""
    BLOCK_TILES = mods.block_tiles
    both = make_index_terms(mods)
    bias_only = make_index_terms(without_mask_mod(mods))
    mask_only = make_index_terms(replace(mods, bias_mod=None, block_tiles=False))

    @cuda.jit(device=True, inline="always")
    def index_terms(b, h, row, col, check_mask):
        if not BLOCK_TILES:
            return both(b, h, row, col)
        extra, _ = bias_only(b, h, row, col)
        hidden = False
        if check_mask:
            _, hidden = mask_only(b, h, row, col)
        return extra, hidden

    return index_terms


@functools.lru_cache(maxsize=None)
def make_hidden_by_mods(mods: CudaMods) -> Any:
    """``hidden_by_mods(b, h, row, col) -> bool``: whether mask_mod or bias_mod hide the pair (mask_mod False, or
    bias_mod -inf) of query ``row`` and key ``col`` of batch ``b``, query head ``h``, for indices inside the
    sequences (the caller's to ensure); always False without those mods."""
    index_terms = make_index_terms(mods)

    @cuda.jit(device=True, inline="always")
    def hidden_by_mods(b, h, row, col):
        extra, hidden = index_terms(b, h, row, col)
        return hidden | (extra == float32(-math.inf))

    return hidden_by_mods


@functools.lru_cache(maxsize=None)
def make_score_mod(mods: CudaMods) -> Any:
    """``score_mod(x, apply, b, h, row, col, last_row, last_col) -> (x, dmod)``: the user's score_mod on the score
    ``x`` (log2 units, after softcap and the additive terms) of query ``row`` and key ``col``, where ``apply`` (the
    caller's: the pair is inside the sequences) and ``x`` is finite, as the reference does; ``dmod`` is
    score_mod_grad there, 1 elsewhere. A -inf it returns hides the pair (the callers test ``x == -inf``); a +inf or
    NaN poisons the row as any non-finite visible score does. Without a score_mod it returns ``(x, 1)`` and
    compiles to nothing.

    Branch-free: the mod runs for every pair, on indices clamped to ``last_row``, ``last_col`` (the sequences' last
    ones, so that a table it reads is read in bounds) and on 0 for a score that is not finite, and a select keeps
    its result where it applies. A branch per score would stop the compiler from interleaving the unrolled score
    loops (measured: 64 more registers in the tensor-core forward, and spills)."""
    SCORE_MOD, GRAD = mods.score_mod, mods.score_mod_grad
    HAS_SCORE_MOD, HAS_GRAD = SCORE_MOD is not None, GRAD is not None

    @cuda.jit(device=True, inline="always")
    def score_mod(x, apply, b, h, row, col, last_row, last_col):
        dmod = float32(1.0)
        if HAS_SCORE_MOD:
            use = apply & (abs(x) < float32(math.inf))
            natural = x * float32(LN2) if use else float32(0.0)
            i, j = int64(min(row, last_row)), int64(min(col, last_col))
            y = float32(SCORE_MOD(natural, int64(b), int64(h), i, j)) * float32(LOG2E)
            x = y if use else x
            if HAS_GRAD:
                g = float32(GRAD(natural, int64(b), int64(h), i, j))
                dmod = g if use else dmod
        return x, dmod

    return score_mod
