"""asv benchmarks of attention: every backend and peer over the seed sizes, causal or not, in three dtypes.

    time_forward / time_backward    wall-clock seconds per call (each call ends with a device synchronize)
    track_peak_memory_*             the extra bytes one call allocates (host: the rise of the peak resident set
                                    during the call; GPU: the allocator's peak), as ``numba-flash bench`` measures
                                    it; asv's own peakmem_ would report the whole process, imports included
    track_gpu_ms_*                  milliseconds between two CUDA events (GPU targets only; unit "ms")
    track_max_error_*               max abs error vs numba_flash's float64 reference (out, or dq/dk/dv)

Parameters: config x backend (cpu, cuda, rocm, numpy_naive, torch_sdpa) x causal x dtype; see common.py for the
skips and the environment variables that narrow or widen the grid. Every target calls attention through
``numba_flash.bench``'s runners and clocks, so asv and ``numba-flash bench`` time the same calls. On GPU machines run with
``--launch-method spawn`` (asv.conf.json sets it): a forked process cannot use a CUDA context made by its parent.
"""

from __future__ import annotations

from typing import Any

from .common import (CAUSAL, AttentionBenchmark, amd_gpu_present, cheap_skip, full_grid, get_target,
                     nvidia_gpu_present, selected_backends, selected_configs, selected_dtypes)


class _Timed(AttentionBenchmark):
    # One call per sample, a few samples: the big sizes take seconds per call on a 2-core CPU. setup runs before
    # every sample, and its target is built only once per process, so the first (compiling) call is never timed.
    number = 1
    repeat = (1, 5, 4.0)
    rounds = 1
    min_run_count = 1
    warmup_time = 0.0


class Forward(_Timed):
    def time_forward(self, config: str, backend: str, causal: bool, dtype: str) -> None:
        self.target.forward()


class Backward(_Timed):
    def setup(self, config: str, backend: str, causal: bool, dtype: str) -> None:
        super().setup(config, backend, causal, dtype)
        self.target.prepare_backward()

    def time_backward(self, config: str, backend: str, causal: bool, dtype: str) -> None:
        self.target.backward()


class Memory(AttentionBenchmark):
    """The call's own extra memory, not the process's: a tiny forward adds a few pages, while the process holding
    numba, torch and the inputs is over 150 MiB."""

    unit = "bytes"

    def track_peak_memory_forward(self, config: str, backend: str, causal: bool, dtype: str) -> int:
        return self.target.peak_bytes(self.target.forward)

    def track_peak_memory_backward(self, config: str, backend: str, causal: bool, dtype: str) -> int:
        self.target.prepare_backward()
        return self.target.peak_bytes(self.target.backward)


class GpuEvents:
    """Kernel time measured on the device with CUDA events, for the targets that run on a GPU."""

    # On a machine without a GPU the grid collapses to one skipped point per config: every point costs a process.
    _gpu = [b for b in selected_backends() if b in ("cuda", "rocm", "torch_sdpa")] \
        if (nvidia_gpu_present() or amd_gpu_present()) else []
    params = [selected_configs(), _gpu or ["cuda"], CAUSAL if _gpu else [False],
              selected_dtypes() if _gpu else ["float32"]]
    param_names = ["config", "backend", "causal", "dtype"]
    unit = "ms"
    timeout = 300.0

    def setup(self, config: str, backend: str, causal: bool, dtype: str) -> None:
        if not (nvidia_gpu_present() or amd_gpu_present()):
            raise NotImplementedError("no GPU")
        self.target = get_target(config, backend, causal, dtype)
        if self.target.gpu is None:
            raise NotImplementedError(f"{backend} runs on the host here")

    def track_gpu_ms_forward(self, config: str, backend: str, causal: bool, dtype: str) -> float:
        return self.target.gpu_ms(self.target.forward)

    def track_gpu_ms_backward(self, config: str, backend: str, causal: bool, dtype: str) -> float:
        return self.target.gpu_ms(self.target.backward, before=self.target.prepare_backward)


def _max_abs_error(result: Any, expected: Any) -> float:
    import numpy as np

    from numba_flash.arrays import as_float64

    return float(np.max(np.abs(as_float64(result) - expected)))


class Accuracy:
    """Max abs error against the float64 reference. ``setup_cache`` computes the whole table in one process: the
    reference of each size is computed once and shared by every target, instead of once per asv process."""

    params = [selected_configs(), selected_backends(), CAUSAL, selected_dtypes()]
    param_names = ["config", "backend", "causal", "dtype"]
    unit = "max abs error"
    timeout = 900.0

    def setup_cache(self) -> dict[tuple, Any]:
        from numba_flash.reference import attention_ref, attention_ref_backward

        table: dict[tuple, Any] = {}
        gpu_machine = nvidia_gpu_present() or amd_gpu_present()
        for config in selected_configs():
            for causal in CAUSAL:
                for dtype in selected_dtypes():
                    ref = None
                    for backend in selected_backends():
                        key = (config, backend, causal, dtype)
                        reason = cheap_skip(*key)
                        if reason is None and config == "s4096" and not gpu_machine and not full_grid():
                            reason = "CPU budget: the float64 reference at S=4096 (NUMBA_FLASH_ASV_FULL=1 runs it)"
                        if reason:
                            table[key] = ("skip", reason)
                            continue
                        try:
                            target = get_target(*key)
                            if ref is None:
                                a = target.reference_inputs()
                                ref = (attention_ref(a["q"], a["k"], a["v"], causal=causal)[0],
                                       attention_ref_backward(a["dout"], a["q"], a["k"], a["v"], causal=causal))
                            fwd = _max_abs_error(target.forward(), ref[0])
                            target.prepare_backward()
                            bwd = max(_max_abs_error(g, r) for g, r in zip(target.backward(), ref[1]))
                            table[key] = ("ok", fwd, bwd)
                        except NotImplementedError as exc:
                            table[key] = ("skip", str(exc))
                        except Exception as exc:  # recorded, and raised by this parameter set's setup below
                            table[key] = ("error", f"{type(exc).__name__}: {exc}")
        return table

    setup_cache.timeout = 900.0

    def setup(self, table: dict[tuple, Any], config: str, backend: str, causal: bool, dtype: str) -> None:
        entry = table[(config, backend, causal, dtype)]
        if entry[0] == "skip":
            raise NotImplementedError(entry[1])
        if entry[0] == "error":
            raise RuntimeError(entry[1])

    def track_max_error_forward(self, table: dict[tuple, Any], config: str, backend: str, causal: bool,
                                dtype: str) -> float:
        return table[(config, backend, causal, dtype)][1]

    def track_max_error_backward(self, table: dict[tuple, Any], config: str, backend: str, causal: bool,
                                 dtype: str) -> float:
        return table[(config, backend, causal, dtype)][2]

