"""``numba-flash bench --varlen``: the packed ("thd") forward over a realistic mix of sequence lengths against a
dense forward of the same work.

The lengths are drawn (seeded) from a log-normal distribution clipped to ``[MIN_LEN, max_len]``: most sequences
are a few hundred tokens and a few are thousands, the long tail of chat and instruction data. They are drawn until
``total_tokens`` is reached (the last one is cut to fit). The dense peer is the same number of sequences, each of
the length S that gives the same sum of Sq * Sk: (n, S, H, D) with n * S^2 = sum(L_i^2), rounded. Its work is
therefore equal up to rounding, and the report compares time per unit of work (FLOPs, ``attention_flops``): a
packed/dense ratio of at most 1 means the packed forward is no slower per token of work than the dense one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..semantics import attention_flops
from .cases import DTYPES, MAX_HEAD_DIM, BenchArgumentError, Skip, to_host64
from .harness import Clock, TimingStats, busy_note, time_calls, timing_fields

# A smaller model than the decode's: the forward's cost grows with the sum of L^2, and the packed and the dense
# call both run every repeat (at these defaults each is about a second on a 2-core CPU).
VARLEN_DEFAULTS = {"nheads": 12, "nheads_kv": 12, "headdim": 64}
DEFAULT_TOTAL_TOKENS = 8192
MEDIAN_LEN, SIGMA, MIN_LEN, MAX_LEN = 512, 1.0, 8, 4096
# The float64 reference's score matrix is (H, L, L): only sequences up to this length are checked.
CHECK_MAX_LEN = 512
VARLEN_COLUMNS = ("mode", "nheads", "nheads_kv", "headdim", "dtype", "causal", "name", "form", "device", "status",
                  "n_seqs", "tokens", "max_seqlen", "flops", "repeats", "min_ms", "median_ms", "p95_ms", "p99_ms",
                  "max_ms", "spread", "tflops", "tokens_per_s", "work_time_vs_dense", "max_err")


def draw_lengths(total_tokens: int, rng: np.random.Generator, max_len: int = MAX_LEN) -> list[int]:
    """Sequence lengths summing to ``total_tokens``: log-normal around ``MEDIAN_LEN`` (scaled down for small
    totals so that there are still several sequences), clipped to ``[MIN_LEN, max_len]``."""
    median = max(MIN_LEN, min(MEDIAN_LEN, total_tokens // 8))
    lens: list[int] = []
    while sum(lens) < total_tokens:
        n = int(np.clip(round(rng.lognormal(math.log(median), SIGMA)), MIN_LEN, max_len))
        lens.append(min(n, total_tokens - sum(lens)))
    return lens


@dataclass(frozen=True)
class VarlenCase:
    """Packed sequences of ``lengths`` with Hq / Hkv heads of size D, and the dense shape of the same work."""

    lengths: tuple[int, ...]
    nheads: int
    nheads_kv: int
    headdim: int
    dtype: str
    causal: bool

    @property
    def dense_shape(self) -> tuple[int, int]:
        """(n, S) with n * S^2 closest to sum(L_i^2): the same work, as n equal sequences."""
        n = len(self.lengths)
        return n, max(1, round(math.sqrt(sum(x * x for x in self.lengths) / n)))

    def flops(self, form: str) -> float:
        if form == "dense":
            n, s = self.dense_shape
            return attention_flops(n, self.nheads, s, s, self.headdim, self.causal)
        return sum(attention_flops(1, self.nheads, x, x, self.headdim, self.causal) for x in self.lengths)

    def tokens(self, form: str) -> int:
        n, s = self.dense_shape
        return n * s if form == "dense" else sum(self.lengths)

    def describe(self) -> str:
        n, s = self.dense_shape
        return (f"varlen {len(self.lengths)} sequences, {sum(self.lengths)} tokens (lengths {min(self.lengths)}.."
                f"{max(self.lengths)}, median {int(np.median(self.lengths))}) Hq={self.nheads} Hkv={self.nheads_kv} "
                f"D={self.headdim} {'causal' if self.causal else 'non-causal'} {self.dtype}; dense peer B={n} S={s}")


def make_varlen_case(rng: np.random.Generator, total_tokens: int | None = None, nheads: int | None = None,
                     nheads_kv: int | None = None, headdim: int | None = None, causal: bool = False,
                     dtype: str = "fp32") -> VarlenCase:
    """The case the flags describe, lengths drawn from ``rng``; BenchArgumentError names a bad setting."""
    hq = nheads or VARLEN_DEFAULTS["nheads"]
    hkv = nheads_kv or (hq if nheads else VARLEN_DEFAULTS["nheads_kv"])
    d = headdim or VARLEN_DEFAULTS["headdim"]
    if dtype not in DTYPES or DTYPES[dtype] == "bfloat16":
        raise BenchArgumentError(f"dtype: --varlen runs float32 or float16 (numpy arrays), got {dtype!r}")
    if hq % hkv:
        raise BenchArgumentError(f"nheads {hq} must be a multiple of nheads_kv {hkv}")
    if d > MAX_HEAD_DIM:
        raise BenchArgumentError(f"headdim {d} is larger than {MAX_HEAD_DIM}, the most every benchmarked backend supports")
    lens = draw_lengths(total_tokens or DEFAULT_TOTAL_TOKENS, rng)
    return VarlenCase(tuple(lens), int(hq), int(hkv), int(d), DTYPES[dtype], bool(causal))


@dataclass
class VarlenRow:
    """One line of the varlen report: a backend's packed or dense forward."""

    kind = "backend"   # no peer runs packed sequences; the attribute lines the row up with the others
    case: VarlenCase
    name: str
    form: str            # 'packed' or 'dense'
    device: str = "cpu"
    status: str = "ok"
    times_ms: list[float] | None = None
    max_err: float | None = None
    work_time_vs_dense: float | None = None

    @property
    def stats(self) -> TimingStats | None:
        return TimingStats.of(self.times_ms) if self.times_ms else None

    @property
    def tflops(self) -> float | None:
        s = self.stats
        return self.case.flops(self.form) / (s.p50_ms * 1e-3) / 1e12 if s else None

    @property
    def tokens_per_s(self) -> float | None:
        s = self.stats
        return self.case.tokens(self.form) / (s.p50_ms * 1e-3) if s else None

    @property
    def label(self) -> str:
        return f"{self.name} ({self.device}) varlen {self.form}"

    def record(self) -> dict[str, Any]:
        c, packed = self.case, self.form == "packed"
        return {"mode": "varlen", "nheads": c.nheads, "nheads_kv": c.nheads_kv, "headdim": c.headdim,
                "dtype": c.dtype, "causal": c.causal, "name": self.name, "form": self.form, "device": self.device,
                "status": self.status, "n_seqs": len(c.lengths), "tokens": c.tokens(self.form),
                "max_seqlen": max(c.lengths) if packed else c.dense_shape[1], "flops": c.flops(self.form),
                **timing_fields(self.stats), "tflops": self.tflops, "tokens_per_s": self.tokens_per_s,
                "work_time_vs_dense": self.work_time_vs_dense, "max_err": self.max_err}


def _packed_error(case: VarlenCase, out: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                  cu: np.ndarray) -> float | None:
    """Max abs error vs the float64 reference over the sequences short enough to check (None if none is)."""
    from ..reference import attention_ref

    out64, errs = to_host64(out), []
    for i, n in enumerate(case.lengths):
        if n <= CHECK_MAX_LEN:
            s, e = cu[i], cu[i + 1]
            ref = attention_ref(q[None, s:e], k[None, s:e], v[None, s:e], causal=case.causal)[0][0]
            errs.append(float(np.max(np.abs(out64[s:e] - ref))))
    return max(errs) if errs else None


@dataclass
class VarlenInputs:
    """Fresh N(0, 1) inputs of a case: packed q (T, Hq, D), k, v (T, Hkv, D) with ``cu`` (n + 1,) int32, and the
    dense peer's q (n, S, Hq, D), k, v (n, S, Hkv, D), in the case's dtype."""

    packed: tuple[np.ndarray, np.ndarray, np.ndarray]
    cu: np.ndarray
    dense: tuple[np.ndarray, np.ndarray, np.ndarray]

    @classmethod
    def draw(cls, case: VarlenCase, rng: np.random.Generator) -> "VarlenInputs":
        def draw(*shape: int) -> np.ndarray:
            return rng.standard_normal(shape, dtype=np.float32).astype(case.dtype, copy=False)

        t, (n, s), hq, hkv, d = sum(case.lengths), case.dense_shape, case.nheads, case.nheads_kv, case.headdim
        cu = np.concatenate([[0], np.cumsum(case.lengths)]).astype(np.int32)
        return cls((draw(t, hq, d), draw(t, hkv, d), draw(t, hkv, d)), cu,
                   (draw(n, s, hq, d), draw(n, s, hkv, d), draw(n, s, hkv, d)))


def varlen_calls(name: str, case: VarlenCase, inputs: VarlenInputs) -> dict[str, Callable[[], Any]]:
    """Backend ``name``'s packed and dense forward on the host, as calls with no arguments (not yet called). The
    bench and the asv suite time these."""
    from numba_flash import backend_registry

    op = backend_registry.get("flash", backend=name)
    longest = max(case.lengths)
    packing = dict(cu_seqlens_q=inputs.cu, cu_seqlens_k=inputs.cu, max_seqlen_q=longest, max_seqlen_k=longest)
    return {"packed": lambda: op.forward(*inputs.packed, causal=case.causal, **packing),
            "dense": lambda: op.forward(*inputs.dense, causal=case.causal)}


def run_varlen_backend(name: str, case: VarlenCase, rng: np.random.Generator, repeats: int,
                       check: bool) -> list[VarlenRow]:
    """The packed and the dense forward of backend ``name`` on fresh N(0, 1) inputs, on the host."""
    from numba_flash.errors import NoBackendError

    inputs = VarlenInputs.draw(case, rng)
    calls = varlen_calls(name, case, inputs)
    rows = []
    for form, fn in calls.items():
        row = VarlenRow(case, name, form)
        try:
            out = fn()  # the first call compiles
            row.times_ms = time_calls(fn, repeats, Clock("host"), warmup=0)
            if check and form == "packed":
                row.max_err = _packed_error(case, out, *inputs.packed, inputs.cu)
        except NoBackendError as exc:
            row.status = "skipped: " + str(exc).splitlines()[0]
        except Skip as exc:
            row.status = f"skipped: {exc}"
        except Exception as exc:  # report and go on, as the dense bench does
            row.status = "error: " + f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        rows.append(row)
    packed, dense = rows
    if packed.stats and dense.stats:
        packed.work_time_vs_dense = ((packed.stats.p50_ms / case.flops("packed"))
                                     / (dense.stats.p50_ms / case.flops("dense")))
    return rows


def execute_varlen(case: VarlenCase, backends: Sequence[str], rng: np.random.Generator, *, repeats: int = 10,
                   check: bool = True, tick: Callable[[], None] = lambda: None) -> tuple[list[VarlenRow], list[str]]:
    """Every backend's packed and dense forward; the rows and the notes to print under the table."""
    rows: list[VarlenRow] = []
    for name in backends:
        rows.extend(run_varlen_backend(name, case, rng, repeats, check))
        tick()
    notes = [busy_note(r.label, r.stats) for r in rows if r.status == "ok" and r.stats and r.stats.busy]
    if check and all(n > CHECK_MAX_LEN for n in case.lengths):
        notes.append(f"max err not computed: every sequence is longer than {CHECK_MAX_LEN} tokens")
    return rows, notes

