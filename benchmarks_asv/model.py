"""asv tracks the static performance model of the CUDA kernels, so the dashboard shows GPU performance moving
commit by commit on machines with no GPU.

    track_ceiling    the model's ceiling: useful FLOP/s as a fraction of the float32 CUDA-core peak (of the dense
                     tensor-core peak for HMMA kernels). A modelled upper bound, not a measurement.
    track_ffma_share FFMA (or MMA) instructions as a fraction of all instructions of a main-loop iteration

Parameters: kernel (forward; backward = the dK/dV and dQ kernels together) x head dim x dtype x compute
capability, plain (no mask) variant; ``python -m numba_flash.cuda.perf_model`` prints every variant. The model
needs the CUDA compiler (the ``cuda`` extra) but no GPU; without it every point is skipped. Results are cached on
disk per source version, so only a commit that changes the kernels pays for compiling them (a few minutes).
"""

from __future__ import annotations

from typing import Any

KERNELS = ["forward", "backward"]
HEAD_DIMS = [64, 128, 256]
DTYPES = ["float32", "float16", "bfloat16"]
CCS = ["8.0", "9.0"]


def _toolchain_reason() -> str | None:
    try:
        import cuda.bindings.nvjitlink  # noqa: F401
        import numba.cuda  # noqa: F401

        from numba_flash.cuda.compile_check.sass import nvdisasm_path

        nvdisasm_path()
    except Exception as exc:   # the cuda extra is not installed: nothing to model
        return f"{type(exc).__name__}: {exc}"
    return None


class CudaModel:
    params = [KERNELS, HEAD_DIMS, DTYPES, CCS]
    param_names = ["kernel", "head_dim", "dtype", "cc"]
    unit = "fraction of peak (model)"
    timeout = 1800.0   # a cold cache compiles every specialisation once

    def setup_cache(self) -> dict[tuple[str, int, str, str], dict[str, Any]]:
        if _toolchain_reason():
            return {}
        from numba_flash.cuda.perf_model import run_model

        ccs = [tuple(int(x) for x in cc.split(".")) for cc in CCS]
        records = run_model(KERNELS, DTYPES, HEAD_DIMS, ["plain"], ccs)
        return {(r.kernel, r.head_dim, r.dtype, r.cc): r.as_json() for r in records}

    def setup(self, cache: dict, kernel: str, head_dim: int, dtype: str, cc: str) -> None:
        if (kernel, head_dim, dtype, cc) not in cache:
            # No toolchain, or a dtype the compute capability is not offered (bfloat16 before 8.0).
            raise NotImplementedError(_toolchain_reason() or f"{dtype} not offered on {cc}")

    def track_ceiling(self, cache: dict, kernel: str, head_dim: int, dtype: str, cc: str) -> float:
        return cache[(kernel, head_dim, dtype, cc)]["ceiling"]

    def track_ffma_share(self, cache: dict, kernel: str, head_dim: int, dtype: str, cc: str) -> float:
        return cache[(kernel, head_dim, dtype, cc)]["ffma_share"]

    track_ffma_share.unit = "fraction of instructions (model)"
