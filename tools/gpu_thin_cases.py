"""GPU cases for the thin launch path (``backends/cuda_thin.py``, ``numba_flash/cuda/host/launch_plan.py``), run by
``tools/gpu_check.py`` (jobs ``thin-<dtype>``; ``--only thin-float16`` runs one): planned launches against numba's
dispatcher, bit for bit, and the host's per-call cost of each.

- forward and backward through the backend with ``NUMBA_FLASH_THIN_LAUNCH`` off, then on (the first call records
  and plans, the next ones replay, one of them on fresh tensors of the same values, one in layout "bhsd"): every
  output equal bit for bit to the dispatcher's;
- a decode step (the decode kernel and the merge of its splits) planned at the host level
  (``launch_plan.record_plan`` over ``flash_decode``), replayed on fresh outputs: equal bit for bit;
- host time per call at the contract's tiny size (B = 1, H = 8, D = 64, S = 64; decode: one query, 1024 keys):
  ``op.forward`` / ``op.backward`` with the thin path off and on, and a bare ``plan.run`` (forward, decode), each
  as the mean of N calls queued without synchronising (the GPU runs them behind the host), in microseconds.

Each case returns gpu_cases' record shape: ``errors`` (here: 1.0 for a tensor that differs, else 0.0; and
``unplanned``: how many of the three signatures the thin path failed to plan, whose reasons ``thin_plans`` lists),
``bounds`` (all 0), ``ok``, ``failed``, and ``host_us`` with the timings. On ``--device cpu`` it says it was skipped.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Callable, Iterator

ENV_VAR = "NUMBA_FLASH_THIN_LAUNCH"


@contextlib.contextmanager
def thin(on: bool) -> Iterator[None]:
    """The thin path on or off within the block (the backend reads the variable per call)."""
    old = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = old


def bits_equal(a: Any, b: Any) -> bool:
    """Whether two tensors hold the same bits (NaNs included), shapes and dtypes equal."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(width), b.contiguous().view(width)))


def differences(named: dict[str, tuple[Any, ...]], reference: tuple[Any, ...]) -> dict[str, float]:
    """{"<label>.<index>": 1.0 if that output differs from ``reference``'s, else 0.0} for each labelled result."""
    return {f"{label}.{i}": 0.0 if bits_equal(got, want) else 1.0
            for label, outs in named.items() for i, (got, want) in enumerate(zip(outs, reference))}


def per_call_us(fn: Callable[[], Any], calls: int, sync: Callable[[], None]) -> float:
    """Mean host time of ``calls`` calls of ``fn`` queued back to back (one synchronise before, none inside), us."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def judge(measured: dict[str, float], host_us: dict[str, float]) -> dict[str, Any]:
    failed = [n for n, e in measured.items() if e != 0.0]
    return {"errors": measured, "bounds": {n: 0.0 for n in measured}, "ok": not failed, "failed": failed,
            "host_us": {n: round(t, 2) for n, t in host_us.items()}}


def thin_launch(ctx: Any, dtype: str, calls: int = 200) -> dict[str, Any]:
    """The thin path against the dispatcher, bit for bit, and its host cost (module docstring)."""
    if ctx.device != "cuda":
        return {"ok": None, "skipped": "thin launch: cuda backend only"}
    import torch

    from backends import cuda_thin

    def sync() -> None:
        torch.cuda.synchronize()

    b, sq, sk, hq, hkv, d = 2, 131, 150, 4, 2, 64
    q, k, v, dout = (ctx.tensor(s, dtype) for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d),
                                                    (b, sq, hq, d)))
    kw = dict(causal=True, return_lse=True)
    measured: dict[str, float] = {}
    with thin(False):
        ref_f = ctx.op.forward(q, k, v, **kw)
        ref_b = ctx.op.backward(dout, q, k, v, ref_f[0], ref_f[1], causal=True)
    with thin(True):
        runs_f = {f"forward{i}": ctx.op.forward(q, k, v, **kw) for i in range(3)}
        runs_f["forward-fresh"] = ctx.op.forward(q.clone(), k.clone(), v.clone(), **kw)
        runs_b = {f"backward{i}": ctx.op.backward(dout, q, k, v, ref_f[0], ref_f[1], causal=True) for i in range(3)}
        runs_b["backward-fresh"] = ctx.op.backward(dout.clone(), q.clone(), k.clone(), v.clone(), ref_f[0].clone(),
                                                   ref_f[1].clone(), causal=True)
        t = [x.transpose(1, 2).contiguous() for x in (q, k, v)]     # "bhsd"
        bhsd = {f"bhsd{i}": ctx.op.forward(*t, layout="bhsd", **kw) for i in range(2)}
    sync()
    measured.update(differences(runs_f, ref_f))
    measured.update(differences(runs_b, ref_b))
    with thin(False):
        ref_bhsd = ctx.op.forward(*t, layout="bhsd", **kw)
    measured.update(differences(bhsd, ref_bhsd))
    # the comparisons above are vacuous unless the thin path served: forward, backward and "bhsd" planned
    planned = cuda_thin.stats()
    measured["unplanned"] = float(max(0, 3 - planned["planned"]))
    measured.update(_decode_bits(ctx, dtype))
    host = _host_costs(ctx, dtype, calls, sync)
    result = judge(measured, host)
    result["thin_plans"] = cuda_thin.stats()
    return result


def _numba_views(*tensors: Any) -> list[Any]:
    from numba import cuda

    from backends.cuda_io import torch_bits

    return [cuda.as_cuda_array(torch_bits(t), sync=False) for t in tensors]


def _decode_plan(ctx: Any, dtype: str, d: int = 64, hq: int = 8, hkv: int = 2, cache: int = 1024,
                 splits: int = 2) -> tuple[Any, tuple, tuple]:
    """(plan, its inputs, the dispatcher's outputs) of a decode step: one query over ``cache`` keys, B = 1."""
    import torch

    from numba_flash.cuda.host.driver_launch import real_driver
    from numba_flash.cuda.host.flash import decode_config
    from numba_flash.cuda.host.launch_decode import flash_decode
    from numba_flash.cuda.host.launch_plan import record_plan

    q = ctx.tensor((1, 1, hq, d), dtype)
    kc, vc = ctx.tensor((1, cache, hkv, d), dtype), ctx.tensor((1, cache, hkv, d), dtype)
    seqinfo = torch.tensor([[0, 0, cache]], dtype=torch.int32, device=ctx.device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=ctx.device)
    part_out = torch.empty(splits, 1, hq, 1, d, device=ctx.device)
    part_lse = torch.empty(splits, 1, hq, 1, device=ctx.device)
    cfg = decode_config(d, dtype, window_left=-1, window_right=-1, softcap=0.0, alibi=False)
    scalars = dict(page_size=0, softmax_scale=1 / math.sqrt(d), window_left=-1, window_right=-1, softcap=0.0,
                   dtype=dtype)

    def outputs() -> tuple:
        return torch.empty_like(q), torch.empty(1, hq, 1, device=ctx.device)

    ref = outputs()
    inputs = (q, kc, vc, seqinfo, table)
    flash_decode(cfg, *_numba_views(*inputs, *ref, part_out, part_lse), **scalars)
    planned = outputs()
    names = ("q", "k_cache", "v_cache", "seqinfo", "block_table", "out", "lse")
    plan, _ = record_plan(lambda: flash_decode(cfg, *_numba_views(*inputs, *planned, part_out, part_lse),
                                               **scalars),
                          dict(zip(names, (*inputs, *planned))), real_driver())
    return plan, inputs, ref


def _decode_bits(ctx: Any, dtype: str) -> dict[str, float]:
    import torch

    plan, inputs, ref = _decode_plan(ctx, dtype)
    runs = {}
    for i in range(2):
        out = (torch.empty_like(ref[0]), torch.empty_like(ref[1]))
        plan.run(*inputs, *out, stream=torch.cuda.current_stream().cuda_stream)
        runs[f"decode{i}"] = out
    torch.cuda.synchronize()
    return differences(runs, ref)


def _host_costs(ctx: Any, dtype: str, calls: int, sync: Callable[[], None]) -> dict[str, float]:
    """Host us per call at the tiny size, thin off and on, and bare plan.run (forward, decode)."""
    import torch

    q, k, v, dout = (ctx.tensor((1, 64, 8, 64), dtype) for _ in range(4))
    out, lse = ctx.op.forward(q, k, v, causal=True, return_lse=True)
    costs = {}
    for on in (False, True):
        label = "thin" if on else "dispatcher"
        with thin(on):
            costs[f"forward_{label}"] = per_call_us(lambda: ctx.op.forward(q, k, v, causal=True), calls, sync)
            costs[f"backward_{label}"] = per_call_us(
                lambda: ctx.op.backward(dout, q, k, v, out, lse, causal=True), calls, sync)
    plan, inputs, ref = _decode_plan(ctx, dtype)
    stream = torch.cuda.current_stream().cuda_stream
    costs["decode_plan_run"] = per_call_us(
        lambda: plan.run(*inputs, torch.empty_like(ref[0]), torch.empty_like(ref[1]), stream=stream), calls, sync)
    sync()
    return costs
