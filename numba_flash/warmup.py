"""``numba-flash warmup``: compile (or load from numba's cache) every CPU kernel specialisation ahead of time.

With a cold cache the first attention call of a process waits 15-35 s while numba compiles; run this once after
installing (``make bench`` and ``make test`` do) and later processes load the kernels in a fraction of a second.

Every specialisation is reached through the public path, small forwards and backwards per compute dtype
(float32, which float16 and bfloat16 inputs are widened to, and float64), with sizes that take every kernel:
a head dim that is not a multiple of 16 (the packing kernel), grouped-query heads and one kv head per batch (the
separate dQ kernel) and enough batch entries for the other (the fused dQ pass); with ``mods``, also with a
mask_mod and a score_mod (the kernels' variant that runs any mods, as long again to compile: it is only for those
who use mods). Each result is checked against the float64 reference, so a stale or broken cache shows up here
rather than in a user's first call.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numba
import numpy as np

DTYPES = ("float32", "float64")
# Max abs error vs the float64 reference on these small N(0, 1) inputs; the float32 bound is the test suite's.
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}


def _band(b: int, h: int, q_idx: int, kv_idx: int) -> bool:
    return abs(q_idx - kv_idx) < 50


def _halved(score: float, b: int, h: int, q_idx: int, kv_idx: int) -> float:
    return 0.5 * score


def _halved_grad(score: float, b: int, h: int, q_idx: int, kv_idx: int) -> float:
    return 0.5


# The kernels with mods are one compilation per dtype for any mods (``numba_flash.cpu.modhooks``): these make it.
MODS = {"mask_mod": _band, "score_mod": _halved}
MODS_GRAD = {"score_mod_grad": _halved_grad}


@dataclasses.dataclass(frozen=True)
class WarmupStep:
    """One dtype made ready: how long it took, what numba compiled for it (empty: all loaded from the cache),
    the largest error of its forward and backward against the float64 reference, and whether the kernels' variant
    for mods was made too."""

    dtype: str
    seconds: float
    compiled: tuple[str, ...]
    max_err: float
    mods: bool = False

    @property
    def ok(self) -> bool:
        """Whether the results matched the reference within ``TOLERANCE``."""
        return self.max_err <= TOLERANCE[self.dtype]

    @property
    def compiled_kernels(self) -> tuple[str, ...]:
        """The parallel kernels among ``compiled`` (the rest are helpers and workers numba compiled into them)."""
        return tuple(n for n in self.compiled if "<locals>" not in n and not n.endswith("_worker"))

    def describe(self) -> str:
        """One line for the command's output."""
        how = f"compiled {len(self.compiled_kernels)} kernels" if self.compiled else "nothing to compile: cached"
        how += "; with their variant for mods" if self.mods else ""
        check = "matches the reference" if self.ok else f"MISMATCH vs the reference: max err {self.max_err:.2e}"
        return f"{self.dtype}: forward and backward ready in {self.seconds:.1f} s ({how}); {check}"


def cache_location() -> str:
    """Where numba keeps the compiled CPU kernels (``__pycache__`` beside the sources unless ``NUMBA_CACHE_DIR``
    or a read-only install moves it)."""
    try:
        from numba_flash.cpu import forward

        path = forward.forward_kernel._cache._cache_path  # numba's own answer; private, so only for display
        return str(path)
    except Exception:  # an older or newer numba without that attribute: say what numba documents
        return "numba's cache directory (NUMBA_CACHE_DIR, else __pycache__ beside the sources)"


def warmup(dtypes: Sequence[str] = DTYPES, *, mods: bool = False, report: Callable[[str], None] | None = None,
           seed: int | None = None) -> list[WarmupStep]:
    """Compile or load every CPU kernel for ``dtypes`` ("float32", "float64"), with ``mods`` also the forward and
    backward kernels' variant for bias_mod, mask_mod and score_mod; returns one step per dtype.

    ``report`` (e.g. ``print``) is called with a line as each dtype starts and ends. Inputs are fresh N(0, 1)
    values (``seed`` replays them). Raises ValueError for an unknown dtype.
    """
    from numba_flash import backend_registry, compile_notice
    from numba_flash.reference import attention_ref, attention_ref_backward

    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise ValueError(f"dtypes: expected some of {', '.join(DTYPES)}, got {', '.join(unknown)}")
    import numba_flash.cpu  # noqa: F401  (installs the compile listener before anything compiles)

    rng = np.random.default_rng(seed)
    op = backend_registry.get("flash", backend="cpu")
    steps = []
    for dtype in dtypes:
        if report is not None:
            report(f"{dtype}: compiling or loading the CPU kernels ...")
        # batch 1 with one kv head: dQ in a pass of its own; a batch of two units per thread: dQ summed in the
        # key-tile pass and stored by a kernel of its own (``schedule.fuse_dq``)
        fused = 2 * numba.get_num_threads()
        cases = [({"causal": True}, {}, 1), ({"causal": True}, {}, fused)] + ([(MODS, MODS_GRAD, 1)] if mods else [])
        before = len(compile_notice.compiled())
        t0 = time.perf_counter()
        err = 0.0
        for kw, grad, batch in cases:   # the plain kernels, fused dQ, their variant for mods (one for any mods)
            q = rng.standard_normal((batch, 70, 2, 40)).astype(dtype)
            k, v = (rng.standard_normal((batch, 75, 1, 40)).astype(dtype) for _ in range(2))
            dout = rng.standard_normal(q.shape).astype(dtype)
            out, lse = op.forward(q, k, v, return_lse=True, **kw)
            grads = op.backward(dout, q, k, v, out, lse, **kw, **grad)
            ref_out = attention_ref(q, k, v, **kw)[0]
            ref_grads = attention_ref_backward(dout, q, k, v, **kw, **grad)
            err = max([err, float(np.max(np.abs(out - ref_out)))] +
                      [float(np.max(np.abs(g - r))) for g, r in zip(grads, ref_grads)])
        seconds = time.perf_counter() - t0
        compiled = tuple(name for name, _ in compile_notice.compiled()[before:])
        step = WarmupStep(dtype, seconds, compiled, err, mods)
        steps.append(step)
        if report is not None:
            report(step.describe())
    return steps
