"""asv benchmarks of the host path of tiny calls (issue 44): what ``numba-flash bench --host-overhead`` measures.

    HostOverhead.time_call        seconds per call (forward, forward_backward, decode) on the cpu backend (numpy)
                                  or the torch faces (CPU tensors), B=1 H=8 D=64, Sq=1 Sk=16
    HostOverhead.track_x_sdpa     the call's median time over torch SDPA's median on the same call, measured
                                  interleaved in one process (goal <= 3, ``host_overhead.GOAL_RATIO``)

Every call is built by ``numba_flash.bench.host_overhead`` (its table of rows), so asv and the bench time the same
thing; rows with no torch installed skip in ``setup``.
"""

from __future__ import annotations

from typing import Any

BACKENDS = ["cpu", "torch"]
CALLS = ["forward", "forward_backward", "decode"]
SIZE = (1, 16)   # the decode-step shape, where the host path is everything


def _case(backend: str, call: str) -> Any:
    """The bench's row for (backend, call) at ``SIZE``; NotImplementedError (asv: skip) where it cannot run."""
    try:
        from numba_flash.bench import host_overhead
    except ImportError as exc:
        raise NotImplementedError(f"numba_flash.bench.host_overhead not importable at this commit: {exc}")
    try:
        import torch  # noqa: F401
        torch_ok = True
    except ImportError:
        torch_ok = False
    if backend == "torch" and not torch_ok:
        raise NotImplementedError("torch not installed")
    rows = host_overhead.host_cases([backend], [call], [SIZE], torch_available=torch_ok)
    return host_overhead, rows[0]


class HostOverhead:
    params = (BACKENDS, CALLS)
    param_names = ["backend", "call"]
    timeout = 300

    def setup(self, backend: str, call: str) -> None:
        import numpy as np

        self.module, self.case = _case(backend, call)
        self.fn = self.case.setup(np.random.default_rng(0))
        for _ in range(5):   # the first call compiles (from numba's disk cache after the first run)
            self.fn()

    def time_call(self, backend: str, call: str) -> None:
        self.fn()

    def track_x_sdpa(self, backend: str, call: str) -> float:
        """Median call time over torch SDPA's median on the same call (``measure``'s interleaved rounds)."""
        if self.case.sdpa is None:
            raise NotImplementedError("no torch SDPA to compare with")
        record = self.module.measure(self.case, repeats=200, rounds=5)
        if record["status"] != "ok":
            raise RuntimeError(record["status"])
        return record["ratio"]

    track_x_sdpa.unit = "x torch SDPA"
