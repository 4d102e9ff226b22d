"""What the bench runs: the seed sizes, one ``Case`` per problem, its random inputs and its float64 reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..reference import attention_ref, attention_ref_backward
from ..semantics import attention_flops
from ..validation import PRECISIONS
from .harness import optional_torch

# (batch, nheads, seqlen, headdim): FlashAttention's minimal_benchmark sizes plus two long sequences.
CONFIGS: dict[str, tuple[int, int, int, int]] = {
    "tiny": (2, 4, 8, 64),
    "small": (2, 4, 64, 64),
    "medium": (2, 8, 128, 64),
    "llama_small": (1, 12, 256, 64),
    "llama_med": (1, 32, 512, 128),
    "s2048": (1, 8, 2048, 64),
    "s4096": (1, 8, 4096, 64),
}
DEFAULT_CONFIG = "llama_small"
# float64 too: the cpu backend and the peers run it; a backend named with --backend that does not is refused before
# the run (bench.cli.unrunnable), one that is not named is skipped with its reason, as for bfloat16.
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64",
          "float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "float64": "float64"}
LAYOUTS = ("bshd", "bhsd")
PASSES = ("fwd", "bwd")
MAX_HEAD_DIM = 256


class Skip(Exception):
    """A backend or peer that cannot run this case; the message says why."""


class BenchArgumentError(ValueError):
    """A bench setting that makes no sense (the command line turns it into a usage error)."""


@dataclass(frozen=True)
class Case:
    """One problem size. Shapes follow ``layout``: q (B, S, Hq, D) for "bshd", (B, Hq, S, D) for "bhsd"."""

    config: str
    batch: int
    nheads: int
    nheads_kv: int
    seqlen: int
    headdim: int
    causal: bool
    dtype: str      # 'float32', 'float16', 'bfloat16', 'float64'
    layout: str
    precision: str = "ieee"   # "tf32": the backends' and torch's float32 products may run in TF32

    def shape(self, heads: int) -> tuple[int, int, int, int]:
        """The shape of an array with ``heads`` heads in this case's layout."""
        if self.layout == "bhsd":
            return (self.batch, heads, self.seqlen, self.headdim)
        return (self.batch, self.seqlen, heads, self.headdim)

    def flops(self, pass_: str) -> float:
        """The contract's FLOP count of one ``pass_`` ('fwd' or 'bwd')."""
        return attention_flops(self.batch, self.nheads, self.seqlen, self.seqlen, self.headdim, self.causal,
                               mode=pass_)

    def describe(self, seqlens: Sequence[int] | None = None) -> str:
        """``llama_small B=1 Hq=12 Hkv=12 S=256 D=64 causal float32 bshd``; ``seqlens`` lists a sweep's lengths."""
        s = ",".join(str(x) for x in seqlens) if seqlens else str(self.seqlen)
        return (f"{self.config} B={self.batch} Hq={self.nheads} Hkv={self.nheads_kv} S={s} D={self.headdim} "
                f"{'causal' if self.causal else 'non-causal'} {self.dtype} {self.layout}"
                + ("" if self.precision == "ieee" else f" precision={self.precision}"))


def make_cases(config: str | None = None, *, batch: int | None = None, nheads: int | None = None,
               nheads_kv: int | None = None, seqlen: int | Sequence[int] | None = None, headdim: int | None = None,
               causal: bool = False, dtype: str = "fp32", layout: str = "bshd", precision: str = "ieee",
               max_headdim: int = MAX_HEAD_DIM) -> list[Case]:
    """One ``Case`` per sequence length: a seed ``config`` (default ``llama_small``) with any field overridden.
    Raises ``BenchArgumentError`` naming the setting that is wrong; ``max_headdim``: the largest head dim allowed
    (the benchmarks' own, or the library's for a case that is only explained)."""
    if config is not None and config not in CONFIGS:
        raise BenchArgumentError(f"config: unknown {config!r}; choose from {', '.join(CONFIGS)}")
    if dtype not in DTYPES:
        raise BenchArgumentError(f"dtype: unknown {dtype!r}; choose from {', '.join(DTYPES)}")
    if layout not in LAYOUTS:
        raise BenchArgumentError(f"layout: unknown {layout!r}; choose from {', '.join(LAYOUTS)}")
    if precision not in PRECISIONS:
        raise BenchArgumentError(f"precision: unknown {precision!r}; choose from {', '.join(PRECISIONS)}")
    seqlens = [seqlen] if isinstance(seqlen, (int, np.integer)) else list(seqlen or [])
    for name, value in (("batch", batch), ("nheads", nheads), ("nheads_kv", nheads_kv), ("headdim", headdim)):
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise BenchArgumentError(f"{name}: expected a positive integer, got {value!r}")
    if any(not isinstance(s, (int, np.integer)) or s < 1 for s in seqlens):
        raise BenchArgumentError(f"seqlen: expected positive integers, got {seqlen!r}")
    custom = any(x is not None for x in (batch, nheads, headdim)) or bool(seqlens)
    b, h, s, d = CONFIGS[config or DEFAULT_CONFIG]
    batch, nheads, headdim = batch or b, nheads or h, headdim or d
    nheads_kv = nheads_kv or nheads
    if nheads % nheads_kv:
        raise BenchArgumentError(f"nheads {nheads} must be a multiple of nheads_kv {nheads_kv}")
    if headdim > max_headdim:
        why = "every benchmarked backend" if max_headdim == MAX_HEAD_DIM else "the library"
        raise BenchArgumentError(f"headdim {headdim} is larger than {max_headdim}, the most {why} supports")
    name = config or ("custom" if custom else DEFAULT_CONFIG)
    return [Case(name, int(batch), int(nheads), int(nheads_kv), int(sl), int(headdim), bool(causal), DTYPES[dtype],
                 layout, precision) for sl in (seqlens or [s])]


class Inputs:
    """Fresh N(0, 1) q, k, v, dout for one case, drawn in float32 on the host and rounded once to the case's
    dtype; every runner and the float64 reference see the same rounded values."""

    def __init__(self, case: Case, rng: np.random.Generator):
        self.case = case
        draw = lambda heads: rng.standard_normal(case.shape(heads), dtype=np.float32)  # noqa: E731
        self.f32 = {"q": draw(case.nheads), "k": draw(case.nheads_kv), "v": draw(case.nheads_kv),
                    "dout": draw(case.nheads)}
        self._cache: dict[tuple[str, str], dict[str, Any]] = {}

    def numpy(self) -> dict[str, np.ndarray]:
        """Host numpy arrays in the case's dtype (float32 / float16); Skip for bfloat16, which numpy lacks."""
        if self.case.dtype == "bfloat16":
            raise Skip("numpy has no bfloat16")
        key = ("numpy", "cpu")
        if key not in self._cache:
            self._cache[key] = {n: a.astype(self.case.dtype) for n, a in self.f32.items()}
        return self._cache[key]

    def torch(self, device: str) -> dict[str, Any]:
        """torch tensors on ``device`` in the case's dtype; Skip when torch is not installed."""
        torch = optional_torch()
        if torch is None:
            raise Skip("torch not installed")
        key = ("torch", device)
        if key not in self._cache:
            dt = getattr(torch, self.case.dtype)
            self._cache[key] = {n: torch.from_numpy(a).to(device=device, dtype=dt) for n, a in self.f32.items()}
        return self._cache[key]

    def numba_cuda(self) -> dict[str, Any]:
        """numba device arrays of the numpy inputs."""
        from numba import cuda

        key = ("numba", "cuda")
        if key not in self._cache:
            self._cache[key] = {n: cuda.to_device(a) for n, a in self.numpy().items()}
        return self._cache[key]

    def reference_inputs(self) -> dict[str, Any]:
        """The rounded inputs the reference must see (torch for bfloat16)."""
        return self.torch("cpu") if self.case.dtype == "bfloat16" else self.numpy()


class Reference:
    """Float64 reference results for one case, computed on first use (the backward one costs a few seconds at
    S = 4096) and shared by every runner."""

    def __init__(self, inputs: Inputs):
        self.inputs = inputs
        self._out: np.ndarray | None = None
        self._grads: tuple[np.ndarray, ...] | None = None

    def _kw(self) -> dict[str, Any]:
        return {"causal": self.inputs.case.causal, "layout": self.inputs.case.layout}

    def out(self) -> np.ndarray:
        """The float64 reference output."""
        if self._out is None:
            a = self.inputs.reference_inputs()
            self._out = attention_ref(a["q"], a["k"], a["v"], **self._kw())[0]
        return self._out

    def grads(self) -> tuple[np.ndarray, ...]:
        """The float64 reference dq, dk, dv for the inputs' dout."""
        if self._grads is None:
            a = self.inputs.reference_inputs()
            self._grads = attention_ref_backward(a["dout"], a["q"], a["k"], a["v"], **self._kw())
        return self._grads


def to_host64(x: Any) -> np.ndarray:
    """Any supported array as a float64 numpy array."""
    from ..arrays import as_float64

    return as_float64(x)
