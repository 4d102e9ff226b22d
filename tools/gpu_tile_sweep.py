"""Time the tensor-core kernels' tile configs (and register caps) on a real NVIDIA GPU, in one short call.

    python tools/gpu_tile_sweep.py --out DIR [--budget SECONDS] [--only NAME,...] [--batch B] [--list]

The static model (numba_flash/cuda/perf_model/__init__.py) says the D = 128 tensor-core kernels are latency-bound: 2 warps
a scheduler at 240 registers cannot hide their chains. Which tile or register cap moves them is a question for the
hardware, so each candidate below runs in its own spawned process with the picker's preferred tile of one kernel
replaced (the kernel's registry entry's ``tiles``) and, for a cap, ``max_registers`` given to that kernel's ``cuda.jit``. Every process
first compiles its kernels and checks its answer (two heads of the timed inputs against float64 SDPA on the
device), then all wait at a barrier and time one at a time: float16, S = 4096, B = 8 (--batch), H = 2048 / D, non-causal and
causal, per-call time of 10 calls queued back to back (5 batches, min / median), the forward or, for a backward
kernel, the backward alone (synchronised calls), and torch SDPA's FlashAttention-2 kernel on the same inputs in the
baseline's process. Results go to DIR/sweep.jsonl as they come, a table to stdout and DIR/sweep_summary.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

from gpu_check import queued_times, run_workers, synced_times, write_summary   # tools/ is this script's path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, SEQLEN, MODEL_DIM, DTYPE = 8, 4096, 2048, "float16"
KERNEL_FUNCTIONS = {"tc_forward": "flash_tc_forward_kernel", "tc_backward_dq": "flash_tc_dq_kernel",
                    "tc_backward_dkdv": "flash_tc_dkdv_kernel"}

#: (kernel, head dim, (block_m, block_n, threads), max_registers or None); the first of each (kernel, head dim)
#: is the picker's own (the baseline). Registers and spills of each on sm_90 (the compiler here): see the note
#: of the session that ran it.
CANDIDATES: list[tuple[str, int, tuple[int, int, int], int | None]] = [
    ("tc_forward", 128, (64, 32, 128), None),
    ("tc_forward", 128, (64, 64, 128), None),
    ("tc_forward", 128, (128, 32, 256), None),
    ("tc_forward", 128, (64, 16, 128), None),
    ("tc_forward", 128, (64, 32, 128), 168),
    ("tc_forward", 128, (128, 32, 256), 168),
    # Two 16-row fragments per warp (threads = 32 * block_m / 32): the model's bound on sm_90 rises from 31% to
    # 45% at D = 128 (no spills on sm_90; 852 bytes on sm_80) and from 30% to 37-40% at D = 64.
    ("tc_forward", 128, (128, 32, 128), None),
    ("tc_forward", 64, (64, 32, 128), None),
    ("tc_forward", 64, (64, 64, 128), None),
    ("tc_forward", 64, (128, 64, 256), None),
    ("tc_forward", 64, (128, 32, 128), None),
    ("tc_forward", 64, (128, 64, 128), None),
    ("tc_backward_dq", 128, (64, 16, 128), None),
    ("tc_backward_dq", 128, (128, 16, 256), None),
    ("tc_backward_dq", 128, (64, 16, 128), 168),
    ("tc_backward_dkdv", 128, (16, 64, 128), None),
    ("tc_backward_dkdv", 128, (16, 64, 128), 168),
]


def name_of(kernel: str, d: int, tile: tuple[int, int, int], cap: int | None) -> str:
    return f"{kernel}-D{d}-{tile[0]}x{tile[1]}x{tile[2]}" + (f"-r{cap}" if cap else "")


def _jit_shim(real_jit: Any, function_name: str, cap: int | None, made: list) -> Any:
    """numba.cuda.jit that adds ``max_registers`` to one kernel's compile and keeps every kernel dispatcher made."""
    def jit(*args, **kwargs):
        if args and callable(args[0]) and not kwargs:
            if cap and args[0].__name__ == function_name:
                kwargs["max_registers"] = cap
            disp = real_jit(*args, **kwargs)
            made.append((args[0].__name__, disp))
            return disp
        return real_jit(*args, **kwargs)
    return jit


def _device_time(fn: Any, calls: int = 10) -> dict[str, float]:
    """Seconds per call the GPU spent in each kernel over ``calls`` calls (torch's profiler, CUPTI: the kernels
    numba launches too), without the host's gaps between them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = us if us is not None else getattr(e, "self_cuda_time_total", 0.0)
        if us:
            out[e.key[:80]] = us / 1e6 / calls
    return out


def worker(cand: tuple, out_dir: str, barrier: Any, lock: Any, deadline: float, wait_for: str | None,
           baseline: bool, batch: int = BATCH, device_times: bool = False) -> None:
    global BATCH
    BATCH = batch
    sys.path[:0] = [ROOT]
    kernel, d, tile, cap = cand
    name = name_of(*cand)
    results = open(os.path.join(out_dir, "sweep.jsonl"), "a", buffering=1)
    log = open(os.path.join(out_dir, "sweep_log.txt"), "a", buffering=1)

    def say(text: str) -> None:
        log.write(f"[{time.strftime('%H:%M:%S')} {name}] {text}\n")

    rec: dict[str, Any] = dict(kind="sweep", name=name, kernel=kernel, D=d, tile=tile, max_registers=cap,
                               baseline=baseline, S=SEQLEN, B=BATCH, H=MODEL_DIM // d, dtype=DTYPE)
    state: dict[str, Any] = {}
    try:
        os.environ.setdefault("NUMBA_FLASH_QUIET", "1")
        import torch
        import torch.nn.functional as F
        from numba import cuda

        from numba_flash.cuda.host import config, picker
        from numba_flash.cuda.kernels.registry import REGISTRY

        made: list = []
        cuda.jit = _jit_shim(cuda.jit, KERNEL_FUNCTIONS[kernel], cap, made)
        REGISTRY[kernel].tiles[d] = tile
        import numba_flash

        cc = cuda.get_current_device().compute_capability
        picked = picker.tile_config_for(d, DTYPE, cc, config.smem_limit_for(cc), kernel)
        rec["picked"] = (picked.block_m, picked.block_n, picked.threads)
        op = numba_flash.backend_registry.get("flash", backend="cuda")
        h = MODEL_DIM // d
        gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
        q, k, v, dout = (torch.randn(BATCH, SEQLEN, h, d, device="cuda", dtype=torch.float16, generator=gen)
                         for _ in range(4))
        backward = kernel != "tc_forward"
        rec["explain"] = str(op.explain(q, k, v)).splitlines()[-3:]
        for causal in (False, True):
            out, lse = op.forward(q, k, v, causal=causal, return_lse=True)
            sl = [x[:1, :, :2].transpose(1, 2).double().requires_grad_(True) for x in (q, k, v)]
            ref = F.scaled_dot_product_attention(*sl, is_causal=causal)
            rec[f"out_rel_l2_c{int(causal)}"] = float((out[:1, :, :2].double().transpose(1, 2) - ref).norm()
                                                      / ref.norm())
            if backward:
                grads = op.backward(dout, q, k, v, out, lse, causal=causal)
                refs = torch.autograd.grad(ref, sl, dout[:1, :, :2].transpose(1, 2).double())
                rec[f"grad_rel_l2_c{int(causal)}"] = [
                    float((g[:1, :, :2].double().transpose(1, 2) - r).norm() / r.norm()) for g, r in zip(grads, refs)]
            state[causal] = (out, lse)
        rec["kernels"] = {}
        for fn, disp in made:
            if fn in KERNEL_FUNCTIONS.values():
                for ov in disp.overloads.values():
                    rec["kernels"][f"{fn}.{len(rec['kernels'])}"] = {
                        "regs": ov.regs_per_thread, "local_bytes": ov.local_mem_per_thread,
                        "shared_bytes": ov.shared_mem_per_block}
        say(f"ready: picked {rec['picked']}, kernels {rec['kernels']}")
    except Exception:
        rec["error"] = traceback.format_exc()[-2000:]
        say(rec["error"])
    try:
        barrier.wait(timeout=max(1.0, deadline - time.time()))
    except threading.BrokenBarrierError:
        say("barrier broken: timing anyway")
    while wait_for and not os.path.exists(wait_for) and time.time() < deadline + 600:
        time.sleep(1.0)
    if "error" not in rec:
        with lock:
            try:
                import torch
                from torch.nn.attention import SDPBackend, sdpa_kernel

                for causal in (False, True):
                    c = int(causal)
                    out, lse = state[causal]
                    if kernel == "tc_forward":
                        rec[f"fwd_s_c{c}"] = queued_times(
                            lambda: op.forward(q, k, v, causal=causal, return_lse=True), "cuda", batches=5)
                        if device_times:
                            rec[f"fwd_dev_c{c}"] = _device_time(
                                lambda: op.forward(q, k, v, causal=causal, return_lse=True))
                    else:
                        rec[f"bwd_s_c{c}"] = synced_times(
                            lambda: op.backward(dout, q, k, v, out, lse, causal=causal), "cuda", 10)
                    if baseline:   # FlashAttention-2 through torch on the same inputs, for the ratio
                        qt, kt, vt, dt_ = (x.transpose(1, 2) for x in (q, k, v, dout))
                        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                            if kernel == "tc_forward":
                                with torch.no_grad():
                                    rec[f"fa2_fwd_s_c{c}"] = queued_times(
                                        lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                                        "cuda", batches=5)
                                    if device_times:
                                        rec[f"fa2_fwd_dev_c{c}"] = _device_time(
                                            lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
                            else:
                                held: dict[str, Any] = {}

                                def prep():
                                    held["l"] = [x.detach().requires_grad_(True) for x in (qt, kt, vt)]
                                    held["o"] = F.scaled_dot_product_attention(*held["l"], is_causal=causal)
                                rec[f"fa2_bwd_s_c{c}"] = synced_times(
                                    lambda: torch.autograd.grad(held["o"], held["l"], dt_), "cuda", 10, prep)
                say("timed")
            except Exception:
                rec["error"] = traceback.format_exc()[-2000:]
                say(rec["error"])
    results.write(json.dumps(rec, default=str) + "\n")


def summary(out_dir: str) -> str:
    import numpy as np

    rows = [json.loads(line) for line in open(os.path.join(out_dir, "sweep.jsonl"))]
    lines = [f"== tile sweep: {DTYPE}, S={SEQLEN}, H=2048/D; ms per call min / median; "
             "FLOP 4 B H S^2 D (x2.5 backward, /2 causal) =="]
    for r in sorted(rows, key=lambda r: (r["kernel"], r["D"], not r["baseline"], r["name"])):
        if "error" in r:
            lines.append(f"{r['name']:<36} ERROR {r['error'].strip().splitlines()[-1][:160]}")
            continue
        regs = {k.replace("flash_", "").replace("_kernel", ""): (v["regs"], v["local_bytes"])
                for k, v in r.get("kernels", {}).items()}
        cells = []
        for c in (0, 1):
            key = ("fwd" if r["kernel"] == "tc_forward" else "bwd") + f"_s_c{c}"
            flop = 4 * r["B"] * r["H"] * r["S"] ** 2 * r["D"] * (1 if key.startswith("fwd") else 2.5) / (1 + c)
            t = r.get(key)
            if t:
                med = float(np.median(t))
                cells.append(f"c{c} {min(t) * 1e3:6.2f}/{med * 1e3:6.2f} ms {flop / med / 1e12:6.1f} TF")
            dev = r.get(key.replace("_s_", "_dev_"))
            if dev:
                cells.append(f"GPU {sum(dev.values()) * 1e3:6.3f} ms")
            fa2 = r.get("fa2_" + key)
            if fa2:
                cells.append(f"FA2 {float(np.median(fa2)) * 1e3:6.2f} ms")
            fa2_dev = r.get("fa2_" + key.replace("_s_", "_dev_"))
            if fa2_dev:
                cells.append(f"FA2 GPU {sum(fa2_dev.values()) * 1e3:6.3f} ms")
        err = r.get("out_rel_l2_c0"), r.get("grad_rel_l2_c0")
        lines.append(f"{r['name']:<36} B={r['B']} picked {tuple(r.get('picked', ()))} regs/local {regs} | " + " | ".join(cells)
                     + f" | err {err}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--budget", type=float, default=150.0, help="seconds for compiling and checking, then timing")
    p.add_argument("--only", help="comma-separated candidate names")
    p.add_argument("--wait-for", help="a file whose existence timing waits for (another job using the GPU)")
    p.add_argument("--batch", type=int, default=BATCH, help="batch size of the timed inputs")
    p.add_argument("--device-times", action="store_true",
                   help="also each forward's GPU time per call from torch's profiler (no host gaps)")
    p.add_argument("--list", action="store_true", help="print the candidates' names and stop")
    a = p.parse_args(argv)
    cands = [c for c in CANDIDATES if not a.only or name_of(*c) in a.only.split(",")]
    if a.list:
        print("\n".join(name_of(*c) for c in cands))
        return 0
    os.makedirs(a.out, exist_ok=True)
    deadline = time.time() + a.budget
    # the first candidate of each (kernel, head dim) is its baseline, which also times FlashAttention-2
    first = [i == [(k, d) for k, d, *_ in cands].index(c[:2]) for i, c in enumerate(cands)]
    run_workers(worker, [lambda barrier, lock, c=c, f=f: (c, a.out, barrier, lock, deadline, a.wait_for, f, a.batch,
                                                           a.device_times) for c, f in zip(cands, first)])
    write_summary(os.path.join(a.out, "sweep_summary.txt"), summary(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
