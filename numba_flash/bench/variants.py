"""``numba-flash bench --variants``: what each attention variant costs on top of the plain forward, per backend,
as ratios measured in one run (issue 14's goals: a bias or dropout within 1.3x of the plain forward, a document
mask_mod that hides 7/8 of the scores at least 4x faster than the plain call), and torch's ``flex_attention`` on
the same calls where this torch build runs it.

Variants: ``plain``; ``attn_bias`` (one (Sq, Sk) float32 table broadcast over batch and heads); ``alibi``;
``bias_mod`` (a per-head linear distance bias); ``mask_mod`` (``DOCUMENTS`` equal documents, each query sees
its own document only), and ``block_mask``, the same with its ``numba_flash.block_mask`` built beforehand (as
flex_attention always needs; without one the CPU kernels evaluate the mask on every tile to find the empty ones);
``score_mod`` (a tanh soft cap written as a mod); ``dropout`` (``DROPOUT_P``, a fixed
seed). A backend that does not run a variant
gets a ``skipped`` line saying why. The outputs are not checked here (the float64 reference would call the Python
mods once per score); the test suite checks every variant against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .cases import BenchArgumentError, Skip
from .harness import Clock, TimingStats, busy_note, time_calls, timing_fields

VARIANTS_DEFAULTS = {"batch": 1, "nheads": 8, "headdim": 64, "seqlen": 4096}
DOCUMENTS = 8
VARIANTS = ("plain", "attn_bias", "alibi", "bias_mod", "mask_mod", "block_mask", "score_mod", "dropout")
VARIANTS_COLUMNS = ("mode", "batch", "nheads", "seqlen", "headdim", "dtype", "name", "variant", "status",
                    "repeats", "min_ms", "median_ms", "p95_ms", "p99_ms", "max_ms", "spread", "time_vs_plain")
SOFT_CAP = 30.0
DROPOUT_P = 0.1   # flash-attn's examples and most training recipes use 0.0-0.1


@dataclass(frozen=True)
class VariantsCase:
    """(B, S, H, D) self-attention, non-causal, Hq = Hkv, in ``dtype``."""

    batch: int
    nheads: int
    seqlen: int
    headdim: int
    dtype: str = "float32"

    def describe(self) -> str:
        return (f"variants B={self.batch} H={self.nheads} S={self.seqlen} D={self.headdim} non-causal {self.dtype}; "
                f"mask_mod: {DOCUMENTS} equal documents")


def make_variants_case(batch: int | None, nheads: int | None, seqlen: int | None, headdim: int | None,
                       dtype: str = "fp32") -> VariantsCase:
    """The case the flags describe; BenchArgumentError names a bad setting."""
    from .cases import DTYPES, MAX_HEAD_DIM

    if DTYPES.get(dtype) not in ("float32", "float16"):
        raise BenchArgumentError(f"dtype: --variants runs float32 or float16 (numpy arrays), got {dtype!r}")
    d = headdim or VARIANTS_DEFAULTS["headdim"]
    if d > MAX_HEAD_DIM:
        raise BenchArgumentError(f"headdim {d} is larger than {MAX_HEAD_DIM}")
    s = seqlen or VARIANTS_DEFAULTS["seqlen"]
    if s % DOCUMENTS:
        raise BenchArgumentError(f"seqlen {s} must be a multiple of {DOCUMENTS} (the mask_mod's documents)")
    return VariantsCase(batch or VARIANTS_DEFAULTS["batch"], nheads or VARIANTS_DEFAULTS["nheads"], s, d,
                        DTYPES[dtype])


def variant_arguments(case: VariantsCase, rng: np.random.Generator) -> dict[str, dict[str, Any]]:
    """The keyword arguments of each variant's forward call (numpy arrays and plain Python mods)."""
    docs = np.repeat(np.arange(DOCUMENTS), case.seqlen // DOCUMENTS)
    slopes = (2.0 ** (-8.0 * np.arange(1, case.nheads + 1) / case.nheads)).astype(np.float32)

    def same_document(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    def distance_bias(b, h, q_idx, kv_idx):
        return -slopes[h] * abs(q_idx - kv_idx)

    def soft_cap(score, b, h, q_idx, kv_idx):
        return SOFT_CAP * math.tanh(score / SOFT_CAP)

    from numba_flash import block_mask

    table = rng.standard_normal((case.seqlen, case.seqlen), dtype=np.float32)
    blocks = block_mask(same_document, 1, 1, case.seqlen, case.seqlen)
    return {"plain": {}, "attn_bias": {"attn_bias": table}, "alibi": {"alibi_slopes": slopes},
            "bias_mod": {"bias_mod": distance_bias}, "mask_mod": {"mask_mod": same_document},
            "block_mask": {"mask_mod": same_document, "block_mask": blocks},
            "score_mod": {"score_mod": soft_cap}, "dropout": {"dropout_p": DROPOUT_P, "dropout_seed": 20261125}}


@dataclass
class VariantRow:
    """One line of the report: a backend's (or flex_attention's) forward with one variant."""

    case: VariantsCase
    name: str
    variant: str
    kind: str = "backend"
    status: str = "ok"
    times_ms: list[float] | None = None
    time_vs_plain: float | None = None

    @property
    def stats(self) -> TimingStats | None:
        return TimingStats.of(self.times_ms) if self.times_ms else None

    @property
    def label(self) -> str:
        return f"{self.name} {self.variant}"

    def record(self) -> dict[str, Any]:
        c = self.case
        return {"mode": "variants", "batch": c.batch, "nheads": c.nheads, "seqlen": c.seqlen, "headdim": c.headdim,
                "dtype": c.dtype, "name": self.name, "variant": self.variant, "status": self.status,
                **timing_fields(self.stats), "time_vs_plain": self.time_vs_plain}


def variant_calls(name: str, qkv: Sequence[np.ndarray], args: dict[str, dict[str, Any]]
                  ) -> dict[str, Callable[[], Any]]:
    """Backend ``name``'s forward per variant on ``qkv`` (B, S, H, D), as calls with no arguments (not yet
    called): the bench and the asv suite time these."""
    from numba_flash import backend_registry

    op = backend_registry.get("flash", backend=name)
    return {v: (lambda kw=kw: op.forward(*qkv, **kw)) for v, kw in args.items()}


def _flex_calls(case: VariantsCase, qkv: Sequence[np.ndarray]) -> dict[str, Callable[[], Any]]:
    """torch's flex_attention (compiled) on the same tensors, for the variants it can express; Skip when this torch
    build has none or cannot compile it here."""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:
        raise Skip(f"torch flex_attention not available: {exc}")
    q, k, v = (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in qkv)
    docs = torch.repeat_interleave(torch.arange(DOCUMENTS), case.seqlen // DOCUMENTS)
    slopes = 2.0 ** (-8.0 * torch.arange(1, case.nheads + 1) / case.nheads)
    flex = torch.compile(flex_attention, dynamic=False)
    block = create_block_mask(lambda b, h, i, j: docs[i] == docs[j], None, None, case.seqlen, case.seqlen,
                              device="cpu")
    calls = {"plain": lambda: flex(q, k, v),
             "bias_mod": lambda: flex(q, k, v, score_mod=lambda s, b, h, i, j: s - slopes[h] * (i - j).abs()),
             "mask_mod": lambda: flex(q, k, v, block_mask=block),   # flex takes a mask only as a block mask
             "block_mask": lambda: flex(q, k, v, block_mask=block),
             "score_mod": lambda: flex(q, k, v, score_mod=lambda s, b, h, i, j: SOFT_CAP * torch.tanh(s / SOFT_CAP))}
    try:
        calls["plain"]()
    except Exception as exc:  # inductor needs a C++ compiler; say what stopped it
        raise Skip("flex_attention did not compile here: " + f"{type(exc).__name__}: {exc}".splitlines()[0][:160])
    return calls


def _time_rows(case: VariantsCase, name: str, kind: str, calls: dict[str, Callable[[], Any]],
               repeats: int) -> list[VariantRow]:
    from numba_flash.errors import NoBackendError

    rows = []
    for variant in VARIANTS:
        row = VariantRow(case, name, variant, kind)
        fn = calls.get(variant)
        if fn is None:
            row.status = f"skipped: {name} has no {variant}"
            rows.append(row)
            continue
        try:
            fn()  # the first call compiles
            row.times_ms = time_calls(fn, repeats, Clock("host"), warmup=0)
        except NoBackendError as exc:
            row.status = "skipped: " + str(exc).splitlines()[0]
        except Exception as exc:  # report and go on, as the other modes do
            row.status = "error: " + f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        rows.append(row)
    plain = rows[0].stats
    for row in rows:
        if plain and row.stats:
            row.time_vs_plain = row.stats.p50_ms / plain.p50_ms
    return rows


def execute_variants(case: VariantsCase, backends: Sequence[str], rng: np.random.Generator, *, repeats: int = 5,
                     flex: bool = True, tick: Callable[[], None] = lambda: None
                     ) -> tuple[list[VariantRow], list[str]]:
    """Every backend's forward per variant on one set of N(0, 1) inputs (B, S, H, D), then flex_attention's."""
    shape = (case.batch, case.seqlen, case.nheads, case.headdim)
    qkv = [rng.standard_normal(shape, dtype=np.float32).astype(case.dtype, copy=False) for _ in range(3)]
    args = variant_arguments(case, rng)
    rows: list[VariantRow] = []
    for name in backends:
        rows.extend(_time_rows(case, name, "backend", variant_calls(name, qkv, args), repeats))
        tick()
    if flex:
        try:
            rows.extend(_time_rows(case, "flex_attention", "peer", _flex_calls(case, qkv), repeats))
        except Skip as exc:
            rows.append(VariantRow(case, "flex_attention", "plain", "peer", status=f"skipped: {exc}"))
    notes = [busy_note(r.label, r.stats) for r in rows if r.status == "ok" and r.stats and r.stats.busy]
    return rows, notes


VARIANTS_HEADERS = ("backend", "variant", "min ms", "P50 ms", "P95 ms", "x plain (P50)")


def format_variants_table(rows: Sequence[VariantRow]) -> str:
    """The measured rows as a table, then one line per skipped or failed row."""
    from tabulate import tabulate

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    body = [(r.name, r.variant, fmt(r.stats.min_ms, ".1f"), fmt(r.stats.p50_ms, ".1f"), fmt(r.stats.p95_ms, ".1f"),
             fmt(r.time_vs_plain, ".2f")) for r in rows if r.status == "ok"]
    text = tabulate(body, headers=VARIANTS_HEADERS, disable_numparse=True)
    return "\n".join([text] + [f"{r.label}: {r.status}" for r in rows if r.status != "ok"])
