"""Host cost of a planned cuda call, measured without a GPU: the thin launch path with the driver's launch replaced
by a recording stub.

The plans are the real ones (``numba_flash.cuda.host.launch_plan``), built the way the backend builds them: the
dispatcher path of one call runs under the recorder (here under the CUDA simulator, recording without running
the kernels), on torch CPU tensors that the simulator's arrays wrap in place, so that the recorded arguments
point into them and bind by address as a GPU's would. Each timed call then does what a planned call does on a
GPU: allocate the outputs with torch, check the arrays against the plan, write pointers, and call the driver's
``cuLaunchKernel`` (the stub, which counts), once per kernel: 1 for a forward, 3 for a backward (delta, dK/dV, dQ), 2 for a decode step (decode, merge). Scratch
(the backward's delta, the decode's split partials) is the plan's workspace, allocated once with it, as
FlashInfer's plans hold theirs: a plan serves one stream at a time, which the backend's plan key (with the stream)
ensures.

Not timed, because only a GPU has them: torch's current-stream lookup (~1 us) and the real ``cuLaunchKernel``
(~3 us per launch through cuda-bindings, issue 44).

    NUMBA_ENABLE_CUDASIM=1 python -m numba_flash.bench.host_overhead_cuda [--calls N] [--json]
    python -m numba_flash.bench.host_overhead_cuda --numba-args     # numba's own argument preparation, to compare

``host_overhead_records()`` runs that in a subprocess with ``NUMBA_ENABLE_CUDASIM=1`` (the simulator must be on
before numba.cuda is first imported) and returns its records.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Callable

from numba_flash.cuda.kernels.registry import AUX_KERNELS, kernel_name

#: The tiny call of the contract's host-path goal: B = 1, H = 8, D = 64, Sq = 64 (forward, backward) and a decode
#: step of one query over a cache of CACHE_LEN keys; float16.
BATCH, HEADS, HEAD_DIM, SEQLEN, CACHE_LEN, DTYPE = 1, 8, 64, 64, 1024, "float16"
#: P95 goals in microseconds (design.md, host path).
GOALS_US = {"forward": 20.0, "backward": 50.0, "decode": 20.0}


def sim_array(t: Any) -> Any:
    """A simulator device array over torch CPU tensor ``t``'s memory (no copy)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(t.numpy())


def sim_plans(driver: Any, dtype: str = DTYPE, head_dim: int = HEAD_DIM, seqlen: int = SEQLEN,
              cache_len: int = CACHE_LEN) -> dict[str, tuple[Any, dict[str, Any]]]:
    """{"forward" | "backward" | "decode": (plan, its call arrays by name)}: the dispatcher path of each call kind
    recorded (without running) under the simulator on torch CPU tensors of ``dtype`` (float32 or float16), B = 1,
    H = 8, planned with ``driver``. Workspace (the backward's delta, the decode's two split partials) is held by
    the plan, not passed per call. The decode step: one query over ``cache_len`` keys, two splits, not paged."""
    import torch

    from numba_flash.cuda.host.flash import decode_config, flash_backward, flash_forward
    from numba_flash.cuda.host.launch_decode import flash_decode
    from numba_flash.cuda.host.launch_plan import record_plan

    dt = getattr(torch, dtype)
    b, h, s, d = BATCH, HEADS, seqlen, head_dim
    q, k, v, out, dout = (torch.randn(b, s, h, d, dtype=dt) for _ in range(5))
    lse, delta = torch.zeros(b, h, s), torch.zeros(b, h, s)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    scalars = dict(softmax_scale=1 / math.sqrt(d), window_left=-1, window_right=0, softcap=0.0, dtype=dtype)
    fwd_arrays = dict(q=q, k=k, v=v, out=out, lse=lse)
    fwd, _ = record_plan(lambda: flash_forward(*map(sim_array, fwd_arrays.values()), **scalars), fwd_arrays, driver,
                         execute=False)
    bwd_arrays = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    bwd, _ = record_plan(lambda: flash_backward(*map(sim_array, (*bwd_arrays.values(), delta)), **scalars), bwd_arrays,
                         driver, execute=False)
    qd = torch.randn(b, 1, h, d, dtype=dt)
    kc, vc = torch.randn(b, cache_len, h, d, dtype=dt), torch.randn(b, cache_len, h, d, dtype=dt)
    seqinfo = torch.tensor([[0, 0, cache_len]] * b, dtype=torch.int32)   # cache row, first key, end key
    splits = 2
    part_out, part_lse = torch.zeros(splits, b, h, 1, d), torch.zeros(splits, b, h, 1)
    cfg = decode_config(d, dtype, window_left=-1, window_right=-1, softcap=0.0, alibi=False)
    dec_arrays = dict(q=qd, k_cache=kc, v_cache=vc, seqinfo=seqinfo, block_table=torch.zeros(1, 1, dtype=torch.int32),
                      out=torch.empty_like(qd), lse=torch.zeros(b, h, 1))
    dec, _ = record_plan(lambda: flash_decode(cfg, *map(sim_array, (*dec_arrays.values(), part_out, part_lse)),
                                              page_size=0, softmax_scale=1 / math.sqrt(d), window_left=-1,
                                              window_right=-1, softcap=0.0, dtype=dtype),
                         dec_arrays, driver, execute=False)
    return {"forward": (fwd, fwd_arrays), "backward": (bwd, bwd_arrays), "decode": (dec, dec_arrays)}


#: Per call kind, how many of its plan's arrays (the last ones) are outputs, allocated per call.
OUTPUTS = {"forward": 2, "backward": 3, "decode": 2}


def planned_calls(driver: Any) -> dict[str, Callable[[], Any]]:
    """One timed-call function per call kind (``sim_plans``' plans, bound to ``driver``): each runs its plan on
    stream 0 with its outputs allocated by torch as planned (``CallPlan.run_new_outputs``), as the backend's planned
    call does on a GPU."""
    calls = {}
    for name, (plan, arrays) in sim_plans(driver).items():
        inputs = tuple(arrays.values())[:-OUTPUTS[name]]

        def call(plan: Any = plan, inputs: tuple = inputs, n_out: int = OUTPUTS[name]) -> Any:
            return plan.run_new_outputs(*inputs, outputs=n_out, stream=0)

        calls[name] = call
    return calls


def time_calls(fn: Callable[[], Any], calls: int, warmup: int = 200) -> list[float]:
    """Per-call times of ``fn`` in microseconds, ``calls`` of them after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    clock = time.perf_counter_ns
    times = []
    for _ in range(calls):
        t0 = clock()
        fn()
        times.append((clock() - t0) / 1000.0)
    return times


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100.0 * (len(ordered) - 1))))]


def measure(calls: int = 2000) -> list[dict[str, Any]]:
    """Records ``{"backend": "cuda", "call", "p50_us", "p95_us", "launches", "goal_p95_us"}`` per call kind, in
    this process (which must run the simulator)."""
    from numba_flash.cuda.host.driver_launch import RecordingDriver

    driver = RecordingDriver(keep=False)
    records = []
    for name, fn in planned_calls(driver).items():
        before = driver.count
        fn()
        launches = driver.count - before
        times = time_calls(fn, calls)
        records.append({"backend": "cuda", "call": name, "p50_us": round(_percentile(times, 50), 2),
                        "p95_us": round(_percentile(times, 95), 2), "launches": launches,
                        "goal_p95_us": GOALS_US[name], "stub": "RecordingDriver.cuLaunchKernel"})
    if driver.others:
        raise RuntimeError(f"the planned calls touched the driver beyond cuLaunchKernel: {sorted(set(driver.others))}")
    return records


AUX_BY_ROLE = {aux.role: aux.name for aux in AUX_KERNELS.values()}
#: The kernels each call kind launches (float16, head dim 64), by their registry roles and kinds, with the names
#: compile_check's ``kernel_signature`` takes.
KERNELS = {"forward": (kernel_name("forward", "mma"),),
           "backward": (AUX_BY_ROLE["delta"], kernel_name("dkdv", "mma"), kernel_name("dq", "mma")),
           "decode": (kernel_name("decode"), AUX_BY_ROLE["merge"])}


def numba_argument_records(calls: int = 300) -> list[dict[str, Any]]:
    """For comparison: the time numba-cuda's dispatcher spends per call in its own argument preparation alone
    (``_Kernel._prepare_args`` for every argument of every launch of the call), on numba device arrays over host
    memory (no driver: their ``gpu_data`` is a stand-in with a ``device_ctypes_pointer``). It leaves out the rest
    of numba's dispatch (typing, context checks, ``as_cuda_array`` per tensor, the launch itself), so it is a
    lower bound of the dispatcher path's host cost. Run without the simulator (``--numba-args``)."""
    import ctypes

    import numpy as np
    from numba.core import types
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    from numba.cuda.dispatcher import _Kernel

    from numba_flash.cuda.compile_check import kernel_signature

    class Memory:   # what DeviceNDArray reads of its gpu_data: the address, and an owner
        def __init__(self, host: np.ndarray):
            self.host, self.owner = host, None
            self.device_ctypes_pointer = ctypes.c_void_p(host.ctypes.data)

        def __int__(self) -> int:
            return int(self.device_ctypes_pointer.value)

    def device_array(ty: Any) -> Any:
        shape = {4: (BATCH, SEQLEN, HEADS, HEAD_DIM), 3: (BATCH, HEADS, SEQLEN), 2: (BATCH, HEADS)}.get(ty.ndim,
                                                                                                     (1,) * ty.ndim)
        host = np.zeros(shape, np.dtype(str(ty.dtype)))
        return DeviceNDArray(host.shape, host.strides, host.dtype, stream=0, gpu_data=Memory(host))

    def value(ty: Any) -> Any:
        if isinstance(ty, types.Array):
            return device_array(ty)
        return {types.float32: np.float32(0.5), types.uint64: np.uint64(1)}.get(ty, 64)

    kernel = _Kernel.__new__(_Kernel)   # only _prepare_args is called, which reads ``extensions``
    kernel.extensions = []
    records = []
    for name, kernels in KERNELS.items():
        launches = []
        for k in kernels:
            argtypes = kernel_signature(k, DTYPE).args
            launches.append((argtypes, [value(t) for t in argtypes]))

        def prepare(launches: list = launches) -> None:
            for argtypes, args in launches:
                flat: list = []
                retr: list = []
                for ty, v in zip(argtypes, args):
                    kernel._prepare_args(ty, v, 0, retr, flat)

        times = time_calls(prepare, calls, warmup=20)
        records.append({"backend": "cuda", "call": name, "path": "numba _prepare_args only",
                        "p50_us": round(_percentile(times, 50), 2), "p95_us": round(_percentile(times, 95), 2),
                        "launches": len(kernels)})
    return records


def host_overhead_records(calls: int = 2000, timeout: float = 600.0) -> list[dict[str, Any]]:
    """``measure(calls)`` in a fresh process under the CUDA simulator; its records. Raises RuntimeError with the
    child's output when it fails."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, "-m", "numba_flash.bench.host_overhead_cuda", "--json",
                           "--calls", str(calls)], env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"host overhead (cuda, stub) failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", action="store_true", help="one JSON list of records on the last line")
    parser.add_argument("--numba-args", action="store_true",
                        help="time numba's own per-launch argument preparation instead (without the simulator)")
    args = parser.parse_args(argv)
    from numba import config

    if args.numba_args:
        if config.ENABLE_CUDASIM:
            print("--numba-args runs without the simulator", file=sys.stderr)
            return 2
        records = numba_argument_records(min(args.calls, 1000))
        if args.json:
            print(json.dumps(records))
        else:
            for r in records:
                print(f"cuda {r['call']:<9} p50 {r['p50_us']:9.2f} us  p95 {r['p95_us']:9.2f} us  "
                      f"({r['launches']} launches; {r['path']})")
        return 0

    if not config.ENABLE_CUDASIM:
        print("run with NUMBA_ENABLE_CUDASIM=1 (or call host_overhead_records())", file=sys.stderr)
        return 2
    records = measure(args.calls)
    if args.json:
        print(json.dumps(records))
    else:
        for r in records:
            print(f"cuda {r['call']:<9} p50 {r['p50_us']:7.2f} us  p95 {r['p95_us']:7.2f} us  "
                  f"({r['launches']} launches; goal p95 <= {r['goal_p95_us']:.0f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
