"""asv benchmarks of inference: one KV-cache decoding step, and the packed (varlen) forward over a mix of lengths.

    Decode.time_decode                 seconds per decoding step (Sq = 1, ``with_kvcache`` without new keys, or
                                       torch SDPA on the same call); each call ends with a device synchronize
    Decode.track_frac_of_copy          the step's GB/s of cache read over a copy of the same bytes, measured in
                                       the same process: the fraction of memory bandwidth it reaches
    Decode.track_peak_memory_decode    the extra bytes one step allocates (split-KV partials), as the bench measures
    Decode.track_max_error             max abs error vs the float64 reference (query heads of KV head 0)
    Varlen.time_forward                seconds per forward: the packed one, or the dense one of the same work
    VarlenRatio.track_work_time_vs_dense   packed time per FLOP over dense time per FLOP (<= 1: no slower per
                                           token of work)

The decode point is the issue's model (B=1, Hq=32, Hkv=8, D=128, float32) at cache lengths 1k and 8k, modest so that
``asv run --quick`` stays fast; ``numba-flash bench --decode`` sweeps to 64k. Every step is built by
``numba_flash.bench.decode`` (and ``.varlen``), so asv and the bench time the same calls. Backends a machine lacks
are parameters all the same and skip in ``setup``, as in ``attention.py``.
"""

from __future__ import annotations

from typing import Any

from .common import amd_gpu_present, nvidia_gpu_present

DECODE_BACKENDS = ["cpu", "cuda", "rocm", "torch_sdpa"]
CACHE_LENS = [1024, 8192]
VARLEN_BACKENDS = ["cpu", "cuda", "rocm"]
FORMS = ["packed", "dense"]
# A 2048-token causal mix with the bench's varlen heads: a fraction of a second per forward on a 2-core CPU.
VARLEN_TOKENS = 2048


def _modules() -> tuple[Any, Any]:
    """``numba_flash.bench``'s decode and varlen modules; a commit from before them skips."""
    try:
        from numba_flash.bench import decode, varlen
    except ImportError as exc:
        raise NotImplementedError(f"numba_flash.bench.decode not importable at this commit: {exc}")
    return decode, varlen


def _gpu_skip(backend: str) -> None:
    if backend == "cuda" and not nvidia_gpu_present():
        raise NotImplementedError("no NVIDIA GPU")
    if backend == "rocm" and not amd_gpu_present():
        raise NotImplementedError("no AMD GPU (ROCm)")


class _Sync:
    """A step that ends with its device's synchronize, so that asv's wall clock times the device's work."""

    def __init__(self, bench: Any, step: Any):
        self.step, self.clock = step, bench.Clock(step.api)

    def __call__(self) -> Any:
        out = self.step.fn()
        self.clock.sync()
        return out


# One decode target per process, kept between asv's setup calls (setup runs before every sample).
_decode: dict[str, Any] = {"key": None}


def decode_target(cache_len: int, backend: str) -> dict[str, Any]:
    """Inputs, the step, the copy yardstick and the reference for one point, built once per process."""
    _gpu_skip(backend)
    if _decode["key"] == (cache_len, backend):
        return _decode
    _decode.clear()
    _decode["key"] = None
    decode, _ = _modules()
    import numpy as np

    from numba_flash import bench

    case = decode.make_decode_cases(cache_lens=[cache_len])[0]
    inputs = decode.DecodeInputs.draw(case, np.random.default_rng(0))
    try:
        step = decode.sdpa_step(inputs) if backend == "torch_sdpa" else decode.backend_step(backend, inputs)
    except decode.Skip as exc:
        raise NotImplementedError(str(exc))
    _decode.update(key=(cache_len, backend), case=case, inputs=inputs, step=step, call=_Sync(bench, step),
                   copy=decode.copy_step(inputs, step.device), bench=bench, decode=decode)
    return _decode


class Decode:
    params = [CACHE_LENS, DECODE_BACKENDS]
    param_names = ["cache_len", "backend"]
    number = 1
    repeat = (3, 10, 4.0)
    warmup_time = 0.0
    timeout = 300.0

    def setup(self, cache_len: int, backend: str) -> None:
        self.t = decode_target(cache_len, backend)

    def time_decode(self, cache_len: int, backend: str) -> None:
        self.t["call"]()

    def track_frac_of_copy(self, cache_len: int, backend: str) -> float:
        """Median step time against median copy time of the same bytes, five of each, interleaved so that a busy
        moment falls on both."""
        import statistics

        bench = self.t["bench"]
        step_clock, copy_clock = bench.Clock(self.t["step"].api), bench.Clock(self.t["copy"].api)
        steps, copies = [], []
        for _ in range(5):
            steps.append(step_clock.time(self.t["step"].fn)[0])
            copies.append(copy_clock.time(self.t["copy"].fn)[0])
        return statistics.median(copies) / statistics.median(steps)

    track_frac_of_copy.unit = "fraction of copy bandwidth"

    def track_peak_memory_decode(self, cache_len: int, backend: str) -> int:
        bench, step = self.t["bench"], self.t["step"]
        if step.device == "cpu":
            return int(bench.measure_host_peak(step.fn)[0])
        return int(bench.measure_gpu_peak(step.fn, step.api)[0])

    track_peak_memory_decode.unit = "bytes"

    def track_max_error(self, cache_len: int, backend: str) -> float:
        decode, inputs = self.t["decode"], self.t["inputs"]
        return decode.max_err_head0(self.t["step"].fn(), inputs.reference_head0())

    track_max_error.unit = "max abs error"


_varlen: dict[str, Any] = {"key": None}


def varlen_target(backend: str) -> dict[str, Any]:
    """The case (a seeded causal length mix), inputs and both forwards of one backend, built once per process."""
    _gpu_skip(backend)
    if _varlen["key"] == backend:
        return _varlen
    _varlen.clear()
    _varlen["key"] = None
    _, varlen = _modules()
    import numpy as np

    from numba_flash.errors import NoBackendError

    rng = np.random.default_rng(0)
    case = varlen.make_varlen_case(rng, VARLEN_TOKENS, causal=True)
    calls = varlen.varlen_calls(backend, case, varlen.VarlenInputs.draw(case, rng))
    try:
        for fn in calls.values():
            fn()  # the first call compiles
    except NoBackendError as exc:
        raise NotImplementedError(str(exc).splitlines()[0])
    _varlen.update(key=backend, case=case, calls=calls)
    return _varlen


class Varlen:
    params = [VARLEN_BACKENDS, FORMS]
    param_names = ["backend", "form"]
    number = 1
    repeat = (1, 5, 4.0)
    warmup_time = 0.0
    timeout = 300.0

    def setup(self, backend: str, form: str) -> None:
        self.t = varlen_target(backend)

    def time_forward(self, backend: str, form: str) -> None:
        self.t["calls"][form]()


class VarlenRatio:
    params = [VARLEN_BACKENDS]
    param_names = ["backend"]
    unit = "packed/dense time per FLOP"
    timeout = 300.0

    def setup(self, backend: str) -> None:
        self.t = varlen_target(backend)

    def track_work_time_vs_dense(self, backend: str) -> float:
        """Packed over dense time per FLOP, medians of three calls each, interleaved."""
        import statistics
        import time

        case, calls = self.t["case"], self.t["calls"]
        times: dict[str, list[float]] = {name: [] for name in FORMS}
        for _ in range(3):
            for name in FORMS:
                t0 = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - t0)
        per_flop = {name: statistics.median(times[name]) / case.flops(name) for name in FORMS}
        return per_flop["packed"] / per_flop["dense"]
