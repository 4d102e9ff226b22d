"""Decoding with a KV cache: the checks of ``with_kvcache``'s arguments and ``KVCacheCall``, the description of a
valid call every backend runs from.

The semantics are flash-attn's ``flash_attn_with_kvcache``:

* The cache holds up to ``capacity`` keys per sequence: ``k_cache`` is ``(B_cache, capacity, Hkv, D)``, or, paged,
  ``(num_blocks, page_size, Hkv, D)`` with ``block_table`` ``(B, max_blocks)`` mapping sequence b's logical page
  n to physical block ``block_table[b, n]`` (capacity ``max_blocks * page_size``).
* Sequence b uses cache row ``cache_batch_idx[b]`` (default b) and holds ``cache_seqlens[b]`` keys (default: the
  whole capacity). New keys ``k``, ``v`` ``(B, S_new, Hkv, D)`` are written in place at positions
  ``cache_seqlens[b] ..`` of that row (the only input ever modified); the query block then attends to positions
  ``[cache_leftpad[b], cache_seqlens[b] + S_new)``: a dense call with ``Sk_b`` keys, bottom-right aligned.
  ALiBi (``alibi_slopes`` (Hq,) or (B, Hq)) is that dense call's: ``-slope * |i + Sk_b - Sq - j|`` with j counted
  from the first key attended.
* Rotary tables ``rotary_cos`` / ``rotary_sin`` ``(seqlen_ro, rotary_dim / 2)`` rotate the new keys at their
  absolute cache positions and q at ``cache_seqlens[b] + t`` (causal or local), else all of q at
  ``cache_seqlens[b]`` (see ``numba_flash.rotary``). They need new keys, as in flash-attn.

Everything is checked before anything is written, so a refused call leaves the cache as it was. What flash-attn
leaves undefined is refused here instead: duplicate ``cache_batch_idx`` entries or shared pages that an append
would write twice, a cache too short for the append, rotary tables too short for the positions.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from .append_target import check_append_target, check_inference_write, shares_elements
from .arrays import array_kind, device_of, dtype_name, is_meta_tensor, to_numpy
from .errors import bad_arg
from .semantics import clamp_window_bound, compute_dtype_name, default_scale, effective_softcap, effective_window
from .validation import MAX_HEAD_DIM, AttentionCall, check_alibi, check_array, check_options, check_same_as_q

INDEX_DTYPES = ("int32", "int64")


@dataclass(frozen=True, eq=False)
class KVCacheCall:
    """A validated ``with_kvcache`` call. Host index arrays are read-only int64 copies of the caller's.

    q: (B, Sq, Hq, D); k_cache, v_cache: (B_cache, capacity, Hkv, D), or paged (num_blocks, page_size, Hkv, D);
    k_new, v_new: (B, S_new, Hkv, D) or None; rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2) or None.
    cache_seqlens (B,): keys held before the append; cache_rows (B,): the cache row of each sequence (not paged);
    key_start (B,): the first key attended (cache_leftpad); block_table (B, max_blocks) or None.
    """

    q: Any
    k_cache: Any
    v_cache: Any
    k_new: Any
    v_new: Any
    rotary_cos: Any
    rotary_sin: Any
    rotary_interleaved: bool
    kind: str
    device: str
    dtype: str
    batch: int
    seqlen_q: int
    seqlen_new: int
    nheads_q: int
    nheads_kv: int
    head_dim: int
    capacity: int
    page_size: int        # 0: not paged
    cache_seqlens: np.ndarray
    cache_rows: np.ndarray | None
    key_start: np.ndarray
    block_table: np.ndarray | None
    causal: bool
    local: bool           # window_size given as other than (-1, -1): flash-attn's "local"
    softmax_scale: float
    window_left: int      # -1 unbounded; not capped (each sequence caps them for its own Sk)
    window_right: int
    softcap: float
    num_splits: int       # 0: the backend chooses
    return_lse: bool
    alibi: np.ndarray | None = None  # ALiBi slopes, a read-only float64 (B, Hq) host array

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def rotary_dim(self) -> int:
        return 0 if self.rotary_cos is None else 2 * int(self.rotary_cos.shape[1])

    @property
    def key_end(self) -> np.ndarray:
        """(B,) one past the last key attended: ``cache_seqlens + S_new``."""
        return self.cache_seqlens + self.seqlen_new

    @property
    def seqlens_k(self) -> np.ndarray:
        """(B,) keys each sequence attends to."""
        return self.key_end - self.key_start

    def window_for(self, seqlen_k: int) -> tuple[int, int]:
        """The window bounds of a dense call with ``seqlen_k`` keys, capped as validation caps a dense call's."""
        return (clamp_window_bound(self.window_left, self.seqlen_q, seqlen_k),
                clamp_window_bound(self.window_right, self.seqlen_q, seqlen_k))

    def dense_call(self) -> AttentionCall:
        """An ``AttentionCall`` describing this call to the dispatcher (dtype, device, sizes with the longest
        sequence's Sk), so that backends decide on a KV-cache call as on a dense one. ``extra["kvcache"]`` is self."""
        sk = max(1, int(self.seqlens_k.max()))
        left, right = self.window_for(sk)
        return AttentionCall(q=self.q, k=self.k_cache, v=self.v_cache, kind=self.kind, device=self.device,
                             dtype=self.dtype, layout="bshd", batch=self.batch, seqlen_q=self.seqlen_q, seqlen_k=sk,
                             nheads_q=self.nheads_q, nheads_kv=self.nheads_kv, head_dim=self.head_dim,
                             causal=self.causal, softmax_scale=self.softmax_scale, window_left=left,
                             window_right=right, softcap=self.softcap, return_lse=self.return_lse,
                             alibi=self.alibi, extra={"kvcache": self})

    def dense_call_like(self, planned: AttentionCall) -> AttentionCall:
        """``dense_call()`` of this call, a step of the plan whose ``dense_call()`` was ``planned`` (same options,
        dtype, sizes but Sk): the fields that differ from step to step set here, the rest copied from
        ``planned`` rather than derived again by ``AttentionCall.__init__`` (a decode step's microseconds)."""
        ends = self.cache_seqlens + self.seqlen_new
        sk = max(1, int((ends - self.key_start).max()))
        left, right = self.window_for(sk)
        call = object.__new__(AttentionCall)   # frozen: set as plan.PlannedCall.run sets a planned call's fields
        call.__dict__.update(planned.__dict__, q=self.q, k=self.k_cache, v=self.v_cache, seqlen_k=sk,
                             window_left=left, window_right=right, extra={"kvcache": self})
        return call


# choose_num_splits: a split shorter than this costs more in its fixed overhead (a unit's setup, a partial
# written and merged) than its parallelism earns. Measured on 2 threads, B = 1, Hkv = 1, Sk = 8192, D = 128:
# 1 split 0.55 ms, 2 to 16 splits 0.26-0.29 ms, 64 splits (128 keys each) 0.32 ms; 512 keys keeps well clear of
# that overhead. It also gates the head blocks of ``numba_flash.cpu.decode._heads_per_unit``.
MIN_KEYS_PER_SPLIT = 512
MAX_SPLITS = 64
UNITS_PER_THREAD = 4  # prange schedules statically: several units per thread even out unequal ones


def choose_num_splits(batch: int, nheads_kv: int, max_seqlen_k: int, n_threads: int) -> int:
    """The number of splits of each batch's keys when the caller passed ``num_splits=0``, 1 to ``MAX_SPLITS``; for
    every backend (``n_threads``: CPU threads, or SMs on a GPU).

    There are ``batch * nheads_kv * num_splits`` work units and numba's prange hands each thread an equal
    contiguous share of them (a GPU spreads blocks over SMs alike). With few (batch, kv head) pairs, e.g. one
    sequence with 8 kv heads on 16 threads, splitting is the only parallelism there is; aiming at
    ``UNITS_PER_THREAD`` units per thread keeps every thread busy even when the units' key spans differ (windows,
    unequal cache lengths). More splits than that
    buy nothing and cost a partial output each, so once ``batch * nheads_kv`` alone is enough there is one split.
    A split must hold at least ``MIN_KEYS_PER_SPLIT`` keys: shorter ones are dominated by their fixed costs.
    Non-decreasing in ``max_seqlen_k`` and ``n_threads``, non-increasing in ``batch`` and ``nheads_kv``.
    """
    pairs = max(1, int(batch) * int(nheads_kv))
    wanted = -(-(UNITS_PER_THREAD * max(1, int(n_threads))) // pairs)
    by_length = max(1, int(max_seqlen_k) // MIN_KEYS_PER_SPLIT)
    return int(max(1, min(wanted, by_length, MAX_SPLITS)))


def host_ints(name: str, x: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
    """``x`` (an integer array of any kind, int32 or int64) as a read-only int64 host copy of ``shape``, or
    AttentionInputError naming ``name``; ``what`` describes the shape in the message ("(B, max_blocks)")."""
    kind = array_kind(x)
    if kind is None:
        raise bad_arg(name, f"an int32 array {what} (numpy, torch or a device array)", f"an object of type "
                      f"{type(x).__name__}")
    if is_meta_tensor(x):
        raise bad_arg(name, f"an int32 array {what} with values to read", "a meta tensor (shapes only)")
    got = tuple(int(s) for s in x.shape)
    if got != shape:
        raise bad_arg(name, f"shape {shape} {what}", f"shape {got}")
    dt = dtype_name(x)
    if dt not in INDEX_DTYPES:
        raise bad_arg(name, "dtype int32 (or int64)", f"dtype {dt}")
    values = np.array(to_numpy(x), dtype=np.int64, copy=True)
    values.flags.writeable = False
    return values


def _first_bad(name: str, values: np.ndarray, ok: np.ndarray, expected: str) -> None:
    bad = np.flatnonzero(~ok)
    if bad.size:
        b = int(bad[0])
        raise bad_arg(name, expected, f"{name}[{b}] = {int(values[b])}")


MAX_NUM_SPLITS = 128  # flash-attn's limit; each part costs a partial output per row


def _share_elements(a: Any, b: Any, kind: str, device: str) -> bool:
    """Whether two caches hold some element in common, exactly (two halves of one packed KV buffer share none)."""
    if kind in ("numpy", "dlpack") and device == "cpu":
        try:
            return bool(np.shares_memory(to_numpy(a), to_numpy(b), max_work=10**6))
        except np.exceptions.TooHardError:
            return bool(np.may_share_memory(to_numpy(a), to_numpy(b)))
    return shares_elements(a, b)  # torch and device arrays: exact from addresses and strides, not data_ptr() alone


def _check_num_splits(num_splits: Any) -> int:
    if (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)
            or not 0 <= num_splits <= MAX_NUM_SPLITS):
        raise bad_arg("num_splits", f"an int from 0 to {MAX_NUM_SPLITS} (0 lets the backend choose)", repr(num_splits))
    return int(num_splits)


def _check_caches(k_cache: Any, v_cache: Any, q_info: tuple, paged: bool,
                  appending: bool) -> tuple[Any, Any, tuple[int, ...]]:
    """The caches against q: 4 dimensions, q's kind, dtype and device, one shape, q's head dim, a head count that
    divides q's; with ``appending`` (k and v given), caches the append can land in (``check_append_target``).
    Returns (k_cache, v_cache, the caches' shape)."""
    _, _, (batch, sq, hq, d), _, _ = q_info
    cache_dims = "(num_blocks, page_size, Hkv, D)" if paged else "(B_cache, capacity, Hkv, D)"
    caches = {}
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if array_kind(x) is not None and len(x.shape) != 4:
            raise bad_arg(name, f"4 dimensions {cache_dims}", f"shape {tuple(int(s) for s in x.shape)}")
        if is_meta_tensor(x):   # read, and written in place: memory it needs
            raise bad_arg(name, f"a cache {cache_dims} in memory", "a meta tensor (shapes only)")
        caches[name] = check_array(name, x, "bshd")
        check_same_as_q(name, caches[name], q_info)
        if appending:  # the caller's own cache, before check_array resolves torch's lazy bits into a copy
            check_append_target(name, x)
    k_cache, v_cache = caches["k_cache"][0], caches["v_cache"][0]
    kc_shape = caches["k_cache"][2]
    if caches["v_cache"][2] != kc_shape:
        raise bad_arg("v_cache", f"the shape of k_cache {kc_shape}", f"shape {caches['v_cache'][2]}")
    hkv = kc_shape[2]
    if kc_shape[3] != d:
        raise bad_arg("k_cache", f"head dim {d} like q", f"head dim {kc_shape[3]} (shape {kc_shape})")
    if d > MAX_HEAD_DIM:
        raise bad_arg("q", f"head dim D between 1 and {MAX_HEAD_DIM}", f"D={d} (shape {(batch, sq, hq, d)})")
    if hq % hkv != 0:
        raise bad_arg("k_cache", f"a number of heads that divides q's {hq} (grouped-query attention)",
                      f"Hkv={hkv} (shape {kc_shape})")
    return k_cache, v_cache, kc_shape


def _check_new_keys(k: Any, v: Any, q_info: tuple, k_cache: Any, v_cache: Any,
                    hkv: int) -> tuple[Any, Any, int]:
    """The keys and values to append: both or neither, (B, S_new, Hkv, D) like q and the caches, into caches that
    can be written and do not overlap. Returns (k, v, S_new), S_new 0 without them."""
    _, qkind, (batch, _, _, d), _, qdev = q_info
    if (k is None) != (v is None):
        raise bad_arg("k" if k is None else "v", "k and v both given (new keys and values to append) or both None",
                      "None" if k is None else "an array")
    if k is None:
        return k, v, 0
    news = {}
    for name, x in (("k", k), ("v", v)):
        news[name] = check_array(name, x, "bshd")
        check_same_as_q(name, news[name], q_info)
    k, v = news["k"][0], news["v"][0]
    want = (batch, news["k"][2][1], hkv, d)
    for name in ("k", "v"):
        if news[name][2] != want:
            raise bad_arg(name, f"shape (B, S_new, Hkv, D) = {want} (B of q, Hkv and D of the cache)",
                          f"shape {news[name][2]}")
    check_append_caches(k_cache, v_cache, qkind, qdev)
    return k, v, want[1]


def check_append_caches(k_cache: Any, v_cache: Any, kind: str, device: str, known_apart: bool = False) -> None:
    """AttentionInputError naming the cache unless both caches (validated, of array kind ``kind`` on ``device``)
    can take an append: writable (a torch inference tensor only inside inference mode), and apart from each other.
    What no array signature holds (a numpy array's writable flag, inference tensors, where two arrays lie), so a
    plan checks it again each step. ``known_apart``: the caller knows these two exact layouts (addresses, shapes,
    strides, dtype) to be apart, so the overlap test, the costly one, is skipped."""
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if kind in ("numpy", "dlpack") and device == "cpu" and not to_numpy(x).flags.writeable:
            raise bad_arg(name, "a writable array (k/v are appended to it in place)", "a read-only array")
        if kind == "torch":
            check_inference_write(name, x)
    if not known_apart and _share_elements(k_cache, v_cache, kind, device):
        raise bad_arg("v_cache", "an array apart from k_cache when k/v are appended (each new position would be "
                      "written twice, the value over the key)", "an array sharing k_cache's memory")


def _check_paging(block_table: Any, cache_batch_idx: Any, cache_leftpad: Any, batch: int,
                  kc_shape: tuple[int, ...]) -> tuple[np.ndarray | None, int, int]:
    """A paged cache's block table (and the arguments a paged cache refuses). Returns (the table as host int64
    or None, page size or 0, keys each sequence can hold)."""
    if block_table is None:
        return None, 0, kc_shape[1]
    if cache_batch_idx is not None:
        raise bad_arg("cache_batch_idx", "None with a paged cache (block_table picks each sequence's pages)",
                      "an array")
    if cache_leftpad is not None:
        raise bad_arg("cache_leftpad", "None with a paged cache (as in flash-attn)", "an array")
    kind = array_kind(block_table)
    if kind is None or len(block_table.shape) != 2 or int(block_table.shape[0]) != batch:
        got = f"shape {tuple(int(s) for s in block_table.shape)}" if kind else type(block_table).__name__
        raise bad_arg("block_table", f"an int32 array (B, max_blocks) with B = {batch}", got)
    table = host_ints("block_table", block_table, (batch, int(block_table.shape[1])), "(B, max_blocks)")
    page_size = kc_shape[1]
    return table, page_size, table.shape[1] * page_size


def cache_lengths(cache_seqlens: Any, batch: int, capacity: int, seqlen_new: int) -> np.ndarray:
    """``cache_seqlens`` as (B,) host int64 (the whole capacity when None), with room for the new keys."""
    if cache_seqlens is None:
        seqlens = np.full(batch, capacity, dtype=np.int64)
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        held = int(cache_seqlens)
        seqlens = np.full(batch, held, dtype=np.int64)
        if batch and 0 <= held <= capacity - seqlen_new:   # every entry is this one: checked as one
            return seqlens
    else:
        seqlens = host_ints("cache_seqlens", cache_seqlens, (batch,), "(B,) or an int")
    # A decode loop runs this every step (a plan's run too): one min and max when all is well (microseconds), the
    # element-wise checks below, which find the first bad entry to name it, only when not.
    if batch and int(seqlens.min()) >= 0 and int(seqlens.max()) + seqlen_new <= capacity:
        return seqlens
    _first_bad("cache_seqlens", seqlens, seqlens >= 0, "every entry >= 0")
    _first_bad("cache_seqlens", seqlens, seqlens + seqlen_new <= capacity,
               f"room for the {seqlen_new} new keys: cache_seqlens[b] + S_new <= the cache's capacity {capacity}")
    return seqlens


def _cache_rows(cache_batch_idx: Any, batch: int, kc_shape: tuple[int, ...], seqlen_new: int) -> np.ndarray:
    """Each sequence's row of an unpaged cache, (B,) host int64: ``cache_batch_idx`` or b."""
    if cache_batch_idx is None:
        if kc_shape[0] < batch:
            raise bad_arg("k_cache", f"at least B = {batch} cache rows (or cache_batch_idx)", f"shape {kc_shape}")
        return np.arange(batch, dtype=np.int64)
    rows = host_ints("cache_batch_idx", cache_batch_idx, (batch,), "(B,)")
    _first_bad("cache_batch_idx", rows, (rows >= 0) & (rows < kc_shape[0]),
               f"cache rows in [0, {kc_shape[0]})")
    if seqlen_new and len(np.unique(rows)) != batch:
        raise bad_arg("cache_batch_idx", "distinct entries when k/v are appended (two sequences would write "
                      "the same cache row)", np.asarray(rows).tolist())
    return rows


def key_starts(cache_leftpad: Any, batch: int, seqlens: np.ndarray) -> np.ndarray:
    """The first key each sequence attends to, (B,) host int64: ``cache_leftpad`` or 0."""
    starts = np.zeros(batch, dtype=np.int64)
    if cache_leftpad is not None:
        starts = host_ints("cache_leftpad", cache_leftpad, (batch,), "(B,)")
        _first_bad("cache_leftpad", starts, (starts >= 0) & (starts <= seqlens), "0 <= cache_leftpad[b] <= "
                   "cache_seqlens[b]")
    return starts


def check_block_indices(table: np.ndarray, pages_used: np.ndarray, num_blocks: int) -> None:
    """AttentionInputError naming ``block_table`` unless the first ``pages_used[b]`` entries of each row b of
    ``table`` (B, max_blocks) int64 name blocks of a paged cache of ``num_blocks``. Entries past them are never
    read and may hold anything (-1 padding, as vLLM's tables do)."""
    used = np.arange(table.shape[1]) < np.asarray(pages_used)[:, None]   # one pass, not one per sequence
    bad = np.argwhere(used & ((table < 0) | (table >= num_blocks)))       # row-major: the first sequence's first
    if len(bad):
        b, n = (int(i) for i in bad[0])
        raise bad_arg("block_table", f"block indices in [0, {num_blocks}) for the pages sequence {b} uses",
                      f"block_table[{b}, {n}] = {int(table[b, n])}")


def check_pages_used(table: np.ndarray, num_blocks: int, page_size: int, seqlens: np.ndarray,
                      seqlen_new: int) -> None:
    """Every page a sequence reads names a block of the cache, and no page written by the append is shared."""
    batch = len(seqlens)
    ends = seqlens + seqlen_new
    pages_used = -(-ends // page_size)
    check_block_indices(table, pages_used, num_blocks)
    if seqlen_new:
        written = [table[b, seqlens[b] // page_size:pages_used[b]] for b in range(batch)]
        flat = np.concatenate(written)
        if len(np.unique(flat)) != len(flat):
            raise bad_arg("block_table", "no page shared by two sequences where k/v are appended (it would be "
                          "written twice)", "a block listed twice among the pages written")


def _check_rotary(rotary_cos: Any, rotary_sin: Any, k: Any, q_info: tuple, causal: bool,
                  window_size: tuple[int, int], seqlens: np.ndarray, seqlen_new: int) -> None:
    """The rotary tables, when given: both, only with new keys, (seqlen_ro, rotary_dim / 2) floating arrays like
    q, long enough for every position rotated."""
    if rotary_cos is None and rotary_sin is None:
        return
    _, qkind, (_, sq, _, d), _, qdev = q_info
    if rotary_cos is None or rotary_sin is None:
        raise bad_arg("rotary_sin" if rotary_sin is None else "rotary_cos", "rotary_cos and rotary_sin both given",
                      "None")
    if k is None:
        raise bad_arg("rotary_cos", "None when no new k/v are appended (rotary is applied to the new keys and q, "
                      "as in flash-attn)", "a table")
    tables = {}
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        kind = array_kind(x)
        if kind is None or len(x.shape) != 2:
            got = f"shape {tuple(int(s) for s in x.shape)}" if kind else type(x).__name__
            raise bad_arg(name, "an array (seqlen_ro, rotary_dim / 2)", got)
        dt = dtype_name(x)
        if kind != qkind or device_of(x) != qdev or dt not in ("float16", "bfloat16", "float32", "float64"):
            raise bad_arg(name, f"a floating {qkind} array on q's device ({qdev})",
                          f"a {kind} array of dtype {dt} on {device_of(x)}")
        tables[name] = tuple(int(s) for s in x.shape)
    if tables["rotary_sin"] != tables["rotary_cos"]:
        raise bad_arg("rotary_sin", f"the shape of rotary_cos {tables['rotary_cos']}",
                      f"shape {tables['rotary_sin']}")
    seqlen_ro, half = tables["rotary_cos"]
    if half < 1 or 2 * half > d:
        raise bad_arg("rotary_cos", f"(seqlen_ro, rotary_dim / 2) with 2 <= rotary_dim <= D = {d}",
                      f"shape {tables['rotary_cos']}")
    check_rotary_rows(seqlen_ro, sq if (causal or tuple(window_size) != (-1, -1)) else 1, seqlens, seqlen_new)


def check_rotary_rows(seqlen_ro: int, q_span: int, seqlens: np.ndarray, seqlen_new: int) -> None:
    """AttentionInputError naming ``rotary_cos`` unless its ``seqlen_ro`` rows reach every position rotated: the
    new keys' and q's (``q_span`` of them: Sq when causal or local, else 1) from ``seqlens`` (B,) int64 on."""
    needed = int(seqlens.max()) + max(seqlen_new, q_span)
    if seqlen_ro < needed:
        raise bad_arg("rotary_cos", f"at least {needed} rows (the new keys' and q's positions reach "
                      f"cache_seqlens + {max(seqlen_new, q_span) - 1})", f"{seqlen_ro} rows")


def validate_kvcache(
    q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, rotary_cos: Any = None, rotary_sin: Any = None,
    cache_seqlens: Any = None, cache_batch_idx: Any = None, cache_leftpad: Any = None, block_table: Any = None,
    softmax_scale: float | None = None, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0, rotary_interleaved: bool = True, alibi_slopes: Any = None, num_splits: int = 0,
    return_lse: bool = False,
) -> KVCacheCall:
    """Check a ``with_kvcache`` call (shapes in the module docstring); raise ``AttentionInputError`` on the first
    violation, before anything is written. The steps run in a fixed order, so the first violation is always the
    same one: options, q, the caches, the new keys, paging, lengths, ALiBi, rows, left padding, pages, rotary."""
    causal, softmax_scale, window_size, softcap, _, return_lse = check_options(
        causal, softmax_scale, window_size, softcap, "bshd", return_lse)
    if not isinstance(rotary_interleaved, (bool, np.bool_)):
        raise bad_arg("rotary_interleaved", "a bool", repr(rotary_interleaved))
    num_splits = _check_num_splits(num_splits)
    q_info = check_array("q", q, "bshd")
    q, qkind, (batch, sq, hq, d), qdt, qdev = q_info
    paged = block_table is not None
    k_cache, v_cache, kc_shape = _check_caches(k_cache, v_cache, q_info, paged, appending=k is not None)
    hkv = kc_shape[2]
    k, v, seqlen_new = _check_new_keys(k, v, q_info, k_cache, v_cache, hkv)
    table, page_size, capacity = _check_paging(block_table, cache_batch_idx, cache_leftpad, batch, kc_shape)
    seqlens = cache_lengths(cache_seqlens, batch, capacity, seqlen_new)
    alibi = check_alibi(alibi_slopes, qkind, qdev, batch, hq, sq, capacity, compute_dtype_name(qdt))
    rows = None if paged else _cache_rows(cache_batch_idx, batch, kc_shape, seqlen_new)
    starts = key_starts(cache_leftpad, batch, seqlens)
    if paged:
        check_pages_used(table, kc_shape[0], page_size, seqlens, seqlen_new)
    _check_rotary(rotary_cos, rotary_sin, k, q_info, causal, window_size, seqlens, seqlen_new)

    left, right = effective_window(causal, window_size)
    return KVCacheCall(
        q=q, k_cache=k_cache, v_cache=v_cache, k_new=k, v_new=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=bool(rotary_interleaved), kind=qkind, device=qdev, dtype=qdt, batch=batch, seqlen_q=sq,
        seqlen_new=seqlen_new, nheads_q=hq, nheads_kv=hkv, head_dim=d, capacity=capacity, page_size=page_size,
        cache_seqlens=seqlens, cache_rows=rows, key_start=starts, block_table=table, causal=causal,
        local=tuple(window_size) != (-1, -1),
        softmax_scale=default_scale(d) if softmax_scale is None else float(softmax_scale), window_left=left,
        window_right=right, softcap=effective_softcap(softcap, compute_dtype_name(qdt)), num_splits=num_splits,
        return_lse=return_lse, alibi=alibi)
