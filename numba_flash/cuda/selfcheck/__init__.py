"""Self-check on first use: before a kernel specialisation serves its first call in a process, it runs once on a
small input against the float64 reference, and one that fails is never used again in that process.

Why: without a GPU the kernels are proven by the simulator, the race checker and the compile check, none of which
runs the real compiler's machine code on real hardware. A miscompile, a driver bug or a race that only real warps
expose would otherwise give wrong numbers silently; the contract wants a refusal with a reason instead.

What is checked: a specialisation is what the kernel factories are keyed on, the kernel (``forward``,
``backward_dkdv``, ``backward_dq``; ``decode`` has a problem of its own, decode_check.py's) x tile config x mask,
softcap, ALiBi and attn_bias flags x dtype x whether it is built for packed sequences in one launch, and it is
checked once per GPU (one that passes on one architecture may fail on another). The input is random N(0, 1) data from a fixed seed (so that a verdict never depends on luck), with
odd sizes that make every tile edge ragged: B = 1, Hq = 2, Hkv = 1 (GQA), D = head-dim bucket - 1, Sq = block_m + 3
(two query tiles), Sk = 2 * block_n + 5 (three key tiles); causal when the specialisation has a right bound, a left
window that crosses a key-tile edge when it has a left bound, softcap 1.5 when it has softcap, slopes drawn from
U(0.05, 0.5) when it has ALiBi, an N(0, 1) bias with one entry in 8 -inf when it has attn_bias; a packed
specialisation gets the same problem as the last of three packed sequences, behind rows and keys of NaN
(problem.py). Outputs start as NaN, so an element the kernel never writes shows up. The backward kernels get ``out`` and ``lse`` from the
reference, so each kernel is judged on its own. Bounds (the contract's): forward float32 out and every dtype's lse,
max abs error <= max(1e-5, 4x the error of textbook float32 attention on the same input); float16 / bfloat16 out and
gradients, relative L2 <= 2e-3 / 1.6e-2; float32 gradients, relative L2 <= 1e-5. An exception while compiling or
running the check counts as a failure.

Cost: the check launches the kernel with arrays of the same numba types (dtype and contiguity) as the call that
triggers it, so it compiles nothing the call would not compile anyway. What it adds, once per specialisation, GPU
and process, is one launch of a few blocks (microseconds), about ten allocations and copies of a few KiB each,
and the float64 reference in numpy (median 0.8 ms over every config the picker makes, measured on a 2-core
machine): a few milliseconds in all, far under 100 ms. Under the simulator the same check costs as much as a
small simulated call, about a second with toy tiles and 3 to 10 s with the picker's 128-thread ones, which is why
it is off there unless asked for.

On a failure the call goes on with the next config of ``FALLBACK_TILES`` (other tile sizes and thread counts,
valid for the head-dim bucket) that passes its own check, and ``explain()`` notes the failure. When none passes,
``choose`` raises
``SelfCheckFailed`` before anything is written; the CUDA backend reports the failures from then on in
``not_supported_reasons``, so the dispatcher moves on to the next backend, or ``NoBackendError`` lists them when
cuda was forced. A check that crashes the GPU context (an illegal address) leaves the context unusable, as any
such kernel would; the check cannot undo that, only make it happen on a tiny input first.

Switch: ``NUMBA_FLASH_SELFCHECK=0`` turns the check off, ``=1`` on (the simulator included). Unset, it is on for a
real GPU and off under the simulator. It is read at every launch; verdicts already reached are kept (``reset()``
forgets them), and while the check is off nothing is checked or refused.

This module imports no ``numba.cuda`` at import time; the checks import it, and the launchers, when they run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from numba_flash.errors import BackendDeclined

from numba_flash.cuda.host.config import STATIC_SMEM_LIMIT, FlashAttentionConfig
from numba_flash.cuda.host.devices import current_device
from numba_flash.cuda.kernels.registry import find
from numba_flash.cuda.selfcheck.problem import (PACKED_INDEX, PACKED_KEYS, PACKED_ROWS, SEED, STRIDED, Problem,
                                                ahead, draw_problem, judge, max_abs, nan_device_like, placed, rel_l2,
                                                textbook_float32, to_device_like, to_storage, widen)

ENV_VAR = "NUMBA_FLASH_SELFCHECK"

#: Configs tried, in order, after the picked one fails: mostly smaller tiles and other thread counts than the
#: picker's (a bug tied to one tile shape or warp count is likely to spare another), ending with a tiny one that
#: every head-dim bucket fits. Each is tried only if it is valid for the bucket.
FALLBACK_TILES: tuple[tuple[int, int, int], ...] = ((32, 16, 128), (16, 16, 64), (8, 8, 32))
#: The same for the tensor-core kernels (one warp per 16 query rows).
TC_FALLBACK_TILES: tuple[tuple[int, int, int], ...] = ((32, 32, 64), (16, 16, 32))

#: The contract's bounds.
FLOAT32_MAX_ABS = 1e-5
TEXTBOOK_FACTOR = 4.0
LOW_PRECISION_REL_L2 = {"float16": 2e-3, "bfloat16": 1.6e-2, "tf32": 2e-3}
#: The TF32 forward's lse: its scores carry the rounding of q and k to 10 mantissa bits (about 1e-3 of a score).
TF32_LSE_MAX_ABS = 1e-2
FLOAT32_BACKWARD_REL_L2 = 1e-5


logger = logging.getLogger("numba_flash")


@dataclass(frozen=True)
class Specialisation:
    """One compiled variant of one kernel: ``cfg.kernel`` is which kernel."""

    cfg: FlashAttentionConfig
    has_left: bool
    has_right: bool
    softcap: bool
    dtype: str
    alibi: bool = False
    bias: bool = False
    dropout: bool = False
    async_copy: bool = True   # tensor-core kernels: tiles copied with cp.async (else plain loads)
    varlen: bool = False      # built for packed sequences in one launch (sequences.py)
    dbias: str = ""           # also attn_bias's gradient: dQ "pairs" or "per_row" sums, dK/dV "per_key" sums

    def tiles(self) -> str:
        """'64x32/128': block_m x block_n / threads."""
        return f"{self.cfg.block_m}x{self.cfg.block_n}/{self.cfg.threads}"

    def describe(self) -> str:
        """e.g. 'forward 64x32/128 D=64 float16 causal softcap'."""
        masks = {(False, False): "", (False, True): " causal", (True, False): " left window",
                 (True, True): " window"}[(self.has_left, self.has_right)]
        return (f"{self.cfg.kernel} {self.tiles()} D={self.cfg.head_dim_bucket} {self.dtype}{masks}"
                + (" softcap" if self.softcap else "") + (" alibi" if self.alibi else "")
                + (" attn_bias" if self.bias else "") + (" dropout" if self.dropout else "")
                + (" plain loads" if self.cfg.tensor_cores and not self.async_copy else "")
                + (" packed" if self.varlen else "") + (f" dbias {self.dbias}" if self.dbias else ""))


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check. ``detail`` gives the measured errors and their bounds (or the exception)."""

    spec: Specialisation
    passed: bool
    detail: str

    @property
    def reason(self) -> str:
        return f"self-check {'passed' if self.passed else 'failed'} for {self.spec.describe()}: {self.detail}"


class SelfCheckFailed(BackendDeclined):
    """No config of a kernel passed its self-check on this GPU; ``reasons`` has one line per config tried."""


# Verdicts per (device id, specialisation). A verdict is stored only once complete, under the specialisation's own
# lock, so a thread never sees half a check and two threads never run the same one; different specialisations
# check in parallel.
_verdicts: dict[tuple[int, Specialisation], Verdict] = {}
_locks: dict[tuple[int, Specialisation], threading.Lock] = {}
_guard = threading.Lock()
_any_failed = False   # lets the per-call lookups of problems() return at once in the common case


def enabled() -> bool:
    """Whether launches check their specialisation first: ``NUMBA_FLASH_SELFCHECK``, else on for a real GPU and
    off under the simulator."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    if value:
        raise ValueError(f"{ENV_VAR}: expected 0 or 1, got {os.environ[ENV_VAR]!r}")
    from numba import config

    return not config.ENABLE_CUDASIM


def has_failures() -> bool:
    """Whether any check has failed in this process (cheap: callers skip their lookups when not)."""
    return _any_failed


def reset() -> None:
    """Forget every verdict (tests; or after a driver update in a long-lived process)."""
    global _any_failed
    with _guard:
        _verdicts.clear()
        _locks.clear()
        _any_failed = False


def verdicts() -> dict[tuple[int, Specialisation], Verdict]:
    """A copy of the verdicts reached so far, keyed by (device id, specialisation)."""
    return dict(_verdicts)


def candidates(cfg: FlashAttentionConfig) -> list[FlashAttentionConfig]:
    """``cfg``, then the ``FALLBACK_TILES`` configs of the same kernel and head-dim bucket that are valid for it. A
    wgmma kernel's then gives way to the mma.sync kernel of its role and its candidates: Hopper's kernel is the
    newest code, and mma.sync serves the same calls on the same GPU."""
    found = [cfg]
    for bm, bn, nt in TC_FALLBACK_TILES if cfg.tensor_cores else FALLBACK_TILES:
        cand = FlashAttentionConfig(cfg.kernel, bm, bn, nt, cfg.head_dim_bucket)
        if cand not in found and not cand.problems(STATIC_SMEM_LIMIT):
            found.append(cand)
    if cfg.spec.kind == "wgmma":
        mma = find(cfg.spec.role, "mma")
        found += candidates(FlashAttentionConfig(mma.name, *mma.tiles[cfg.head_dim_bucket], cfg.head_dim_bucket))
    return found


def check(spec: Specialisation, like: dict[str, Any] | None = None, device: int | None = None) -> Verdict:
    """The verdict on ``spec`` for ``device`` (default: the current GPU), running the check only the first time.

    ``like`` maps argument names of the launch (q, k, v, out, lse, dout, dq, dk, dv, delta) to the call's device
    arrays: the check's arrays copy their contiguity, so the check compiles the same code the call runs.
    """
    global _any_failed
    key = (current_device() if device is None else device, spec)
    verdict = _verdicts.get(key)
    if verdict is not None:
        return verdict
    with _guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        verdict = _verdicts.get(key)
        if verdict is None:
            verdict = _run(spec, like or {})
            if verdict.passed:
                logger.debug("numba_flash cuda: %s", verdict.reason)
            else:
                logger.warning("numba_flash cuda: %s", verdict.reason)
                _any_failed = True
            _verdicts[key] = verdict
    return verdict


def choose(cfg: FlashAttentionConfig, has_left: bool, has_right: bool, softcap: bool, dtype: str,
           like: dict[str, Any] | None = None, alibi: bool = False, bias: bool = False,
           dropout: bool = False, async_copy: bool = True, varlen: bool = False,
           dbias: str = "") -> FlashAttentionConfig:
    """The config to launch: ``cfg`` if it passes its check (or the check is off), else the first fallback that
    passes; ``SelfCheckFailed`` with every failure when none does. ``async_copy``: the tensor-core kernels' copy
    path the call takes (``launch.async_copy_ok`` of its arrays); ``varlen``: the call is packed sequences (the
    check then runs its problem as the last of three packed sequences, ``PACKED_ROWS``); ``dbias``: the kernel
    also sums attn_bias's gradient, each pair's or its sums over keys (dQ: "pairs", "per_row") or over rows (dK/dV:
    "per_key"), checked against the reference's summed likewise."""
    if not enabled():
        return cfg
    failures = []
    for cand in candidates(cfg):
        verdict = check(Specialisation(cand, has_left, has_right, softcap, dtype, alibi, bias, dropout,
                                       async_copy, varlen, dbias), like)
        if verdict.passed:
            return cand
        failures.append(verdict.reason)
    raise SelfCheckFailed(failures)


def problems(cfgs: list[FlashAttentionConfig], has_left: bool, has_right: bool, softcap: bool, dtype: str,
             device: int | None = None, alibi: bool = False, bias: bool = False,
             dropout: bool = False) -> tuple[list[str], list[str]]:
    """What is known so far about the configs a call would pick, without running any check: (notes, reasons).
    A note says a config failed and which fallback serves instead; a reason says no config of a kernel passed."""
    notes: list[str] = []
    reasons: list[str] = []
    if not _any_failed or not enabled():
        return notes, reasons
    dev = current_device() if device is None else device
    for cfg in cfgs:
        failures = []
        for cand in candidates(cfg):
            spec = Specialisation(cand, has_left, has_right, softcap, dtype, alibi, bias, dropout)
            verdict = _verdicts.get((dev, spec))
            if verdict is None and cand.tensor_cores:   # the call's copy path is not known here: either one
                verdict = _verdicts.get((dev, Specialisation(cand, has_left, has_right, softcap, dtype, alibi,
                                                             bias, dropout, False)))
            if verdict is None:       # not checked yet: only what failed before it is known
                if failures:
                    notes.append(f"{'; '.join(failures)}; {spec.tiles()} not checked yet")
                break
            if verdict.passed:
                if failures:
                    other = f"{cand.kernel} " if cand.kernel != cfg.kernel else ""   # wgmma's mma.sync fallback
                    notes.append(f"{'; '.join(failures)}; using {other}{spec.tiles()} instead")
                break
            failures.append(verdict.reason)
        else:
            reasons.extend(failures)
    return notes, reasons


# ---- the checks ----

_quiet_guard = threading.Lock()
_quiet_depth = 0
_quiet_saved: Any = None


@contextlib.contextmanager
def small_grids_unannounced() -> Iterator[None]:
    """numba-cuda warns about every launch of fewer than 128 blocks ("NumbaPerformanceWarning: Grid size 4 will likely
    result in GPU under-utilization"). The check's launches are a few blocks on purpose, and on an H200 that warning
    greeted a user's first call, about a grid that was never theirs; a small call's grids are its shape's, nothing a
    user tunes (the cuda backend's calls run inside this too, backends/cuda_io.py). numba's own switch, read at each
    launch, is off while any such block runs (a count, so that blocks on two threads do not restore each other's
    state)."""
    global _quiet_depth, _quiet_saved
    from numba.core import config as numba_config

    with _quiet_guard:
        if _quiet_depth == 0:
            _quiet_saved = getattr(numba_config, "CUDA_LOW_OCCUPANCY_WARNINGS", None)
            numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_guard:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                if _quiet_saved is None:
                    del numba_config.CUDA_LOW_OCCUPANCY_WARNINGS
                else:
                    numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = _quiet_saved


def _run(spec: Specialisation, like: dict[str, Any]) -> Verdict:
    """Run the check of ``spec`` on the current GPU: a verdict, never an exception."""
    try:
        with small_grids_unannounced():
            failed, measured = _CHECKS[spec.cfg.spec.role](spec, like)
    except Exception as exc:  # any failure to compile or run is a failure of the specialisation
        text = " ".join(str(exc).split())
        return Verdict(spec, False, f"raised {type(exc).__name__}: {text[:300]}")
    return Verdict(spec, not failed, "; ".join(failed or measured))


def _launch_kw(spec: Specialisation, p: Problem, like: dict[str, Any]) -> dict[str, Any]:
    from numba_flash.cuda.host.launch import alibi_arg, dropout_arg

    slopes, batch0, packed = p.slopes, 0, None
    if spec.varlen:
        sq, sk = p.q.shape[1], p.k.shape[1]
        packed = (np.array([0, PACKED_ROWS, PACKED_ROWS, PACKED_ROWS + sq]),
                  np.array([0, 0, PACKED_KEYS, PACKED_KEYS + sk]))
        if slopes is not None:   # the checked sequence's row of slopes is its index's
            slopes = np.concatenate([np.full((PACKED_INDEX, slopes.shape[1]), np.nan), slopes])
        batch0 = -PACKED_INDEX   # dropout keyed as the reference's batch 0
    return dict(softmax_scale=p.scale, window_left=p.window_left, window_right=p.window_right, softcap=p.softcap,
                bf16=spec.dtype == "bfloat16", alibi=alibi_arg(slopes),
                dropout=dropout_arg(p.dropout_p, SEED, batch0), packed=packed,
                bias=None if p.bias is None else to_device_like(p.bias, like.get("bias")))


def _check_forward(spec: Specialisation, like: dict[str, Any]) -> tuple[list[str], list[str]]:
    from numba_flash.reference import attention_ref

    from numba_flash.cuda.host.config import storage_dtype
    from numba_flash.cuda.host.launch import launch_forward

    p = draw_problem(spec)
    store = storage_dtype(spec.dtype)
    if spec.cfg.tensor_cores:   # contiguous rows of a multiple of 8 elements for cp.async, strided ones for loads
        like = {} if spec.async_copy else {n: STRIDED for n in ("q", "k", "v")}
    q = to_device_like(placed(spec, p.stored["q"], "rows"), like.get("q"))
    k, v = (to_device_like(placed(spec, p.stored[n], "keys"), like.get(n)) for n in ("k", "v"))
    rows = ahead(spec, "rows")
    batch, sq, hq, d = p.q.shape
    out = nan_device_like((batch, rows + sq, hq, d), store, like.get("out"))
    lse = nan_device_like((batch, hq, rows + sq), "float32", like.get("lse"))
    launch_forward(spec.cfg, q, k, v, out, lse, **_launch_kw(spec, p, like))
    got_out, got_lse = widen(out.copy_to_host()[:, rows:], spec.dtype), lse.copy_to_host()[:, :, rows:]

    ref_out, ref_lse = attention_ref(p.q, p.k, p.v, softmax_scale=p.scale, window_size=p.window_size,
                                     softcap=p.softcap, alibi_slopes=p.slopes, attn_bias=p.bias,
                                     dropout_p=p.dropout_p, dropout_seed=SEED)
    tb_out, tb_lse = textbook_float32(p)
    lse_bound = max(FLOAT32_MAX_ABS, TEXTBOOK_FACTOR * max_abs(tb_lse, ref_lse))
    if spec.cfg.spec.kind == "tf32":   # TF32 has float16's mantissa: judged as float16 is
        measured = [("out", "relative L2 error", rel_l2(got_out, ref_out), LOW_PRECISION_REL_L2["tf32"])]
        lse_bound = max(lse_bound, TF32_LSE_MAX_ABS)
    elif spec.dtype == "float32":
        out_bound = max(FLOAT32_MAX_ABS, TEXTBOOK_FACTOR * max_abs(tb_out, ref_out))
        measured = [("out", "max abs error", max_abs(got_out, ref_out), out_bound)]
    else:
        measured = [("out", "relative L2 error", rel_l2(got_out, ref_out), LOW_PRECISION_REL_L2[spec.dtype])]
    measured.append(("lse", "max abs error", max_abs(got_lse, ref_lse), lse_bound))
    return judge(measured)


def _backward_inputs(spec: Specialisation, like: dict[str, Any]) -> tuple[Problem, dict[str, Any], tuple]:
    """The problem, its device arrays with delta computed by the delta kernel, and the reference gradients."""
    from numba_flash.reference import attention_ref, attention_ref_backward

    from numba_flash.cuda.host.launch import launch_delta

    p = draw_problem(spec)
    if spec.cfg.tensor_cores:   # as in _check_forward: the layout decides the copy path under check
        like = {} if spec.async_copy else {n: STRIDED for n in ("q", "k", "v", "dout")}
    kw = dict(softmax_scale=p.scale, window_size=p.window_size, softcap=p.softcap, alibi_slopes=p.slopes,
              attn_bias=p.bias, dropout_p=p.dropout_p, dropout_seed=SEED)
    ref_out, ref_lse = attention_ref(p.q, p.k, p.v, **kw)
    grads = attention_ref_backward(p.dout, p.q, p.k, p.v, return_dbias=bool(spec.dbias), **kw)
    side = dict(q="rows", dout="rows", k="keys", v="keys")
    dev = {n: to_device_like(placed(spec, p.stored[n], side[n]), like.get(n)) for n in side}
    out_host = to_storage(ref_out.astype(np.float32), spec.dtype)
    dev["out"] = to_device_like(placed(spec, out_host, "rows"), like.get("out"))
    dev["lse"] = to_device_like(placed(spec, ref_lse.astype(np.float32), "rows", 2), like.get("lse"))
    nan_rows = np.full(ref_lse.shape, np.nan, np.float32)
    dev["delta"] = to_device_like(placed(spec, nan_rows, "rows", 2), like.get("delta"))
    launch_delta(dev["dout"], dev["out"], dev["delta"], bf16=spec.dtype == "bfloat16")
    return p, dev, grads


def _grad_bound(dtype: str) -> float:
    return FLOAT32_BACKWARD_REL_L2 if dtype == "float32" else LOW_PRECISION_REL_L2[dtype]


def _check_dkdv(spec: Specialisation, like: dict[str, Any]) -> tuple[list[str], list[str]]:
    from numba_flash.cuda.host.config import storage_dtype
    from numba_flash.cuda.host.launch import launch_dkdv

    p, dev, (_, ref_dk, ref_dv, *ref_dbias) = _backward_inputs(spec, like)
    keys = ahead(spec, "keys")
    shape = (p.k.shape[0], keys + p.k.shape[1]) + p.k.shape[2:]
    dk = nan_device_like(shape, storage_dtype(spec.dtype), like.get("dk"))
    dv = nan_device_like(shape, storage_dtype(spec.dtype), like.get("dv"))
    dbias = to_device_like(np.zeros(ref_dbias[0].sum(2, keepdims=True).shape, np.float32), None) if spec.dbias else None
    launch_dkdv(spec.cfg, dev["q"], dev["k"], dev["v"], dev["dout"], dev["lse"], dev["delta"], dk, dv, dbias=dbias,
                **_launch_kw(spec, p, like))
    bound = _grad_bound(spec.dtype)
    measured = [(name, "relative L2 error", rel_l2(widen(got.copy_to_host()[:, keys:], spec.dtype), ref), bound)
                for name, got, ref in (("dk", dk, ref_dk), ("dv", dv, ref_dv))]
    if spec.dbias:   # "per_key": each key's sum over the rows, judged as the gradients are
        measured.append(("dbias", "relative L2 error",
                         rel_l2(dbias.copy_to_host(), ref_dbias[0].sum(2, keepdims=True)), bound))
    return judge(measured)


def _check_dq(spec: Specialisation, like: dict[str, Any]) -> tuple[list[str], list[str]]:
    from numba_flash.cuda.host.config import storage_dtype
    from numba_flash.cuda.host.launch import launch_dq

    p, dev, (ref_dq, _, _, *ref_dbias) = _backward_inputs(spec, like)
    rows = ahead(spec, "rows")
    dq = nan_device_like((p.q.shape[0], rows + p.q.shape[1]) + p.q.shape[2:], storage_dtype(spec.dtype), like.get("dq"))
    want_dbias = None
    if spec.dbias:   # "per_row": each row's sum over the keys
        want_dbias = ref_dbias[0].sum(3, keepdims=True) if spec.dbias == "per_row" else ref_dbias[0]
    dbias = to_device_like(np.zeros(want_dbias.shape, np.float32), None) if spec.dbias else None
    launch_dq(spec.cfg, dev["q"], dev["k"], dev["v"], dev["dout"], dev["lse"], dev["delta"], dq, dbias=dbias,
              **_launch_kw(spec, p, like))
    got = widen(dq.copy_to_host()[:, rows:], spec.dtype)
    bound = _grad_bound(spec.dtype)
    measured = [("dq", "relative L2 error", rel_l2(got, ref_dq), bound)]
    if spec.dbias:   # float32 whatever the inputs' dtype, judged as their gradients are
        # A row's sum is of terms that cancel (softmax ignores a shift of a row), so its error is judged against
        # the pairs' gradient it sums.
        scale = ref_dbias[0] if spec.dbias == "per_row" else None
        measured.append(("dbias", "relative L2 error", rel_l2(dbias.copy_to_host(), want_dbias, scale), bound))
    return judge(measured)


def _check_decode(spec: Specialisation, like: dict[str, Any]) -> tuple[list[str], list[str]]:
    # a decoding problem of its own: see decode_check.py
    from numba_flash.cuda.selfcheck.decode_check import check_decode

    return check_decode(spec, like)


#: The check of a kernel, by its registry entry's role.
_CHECKS: dict[str, Callable[[Specialisation, dict[str, Any]], tuple[list[str], list[str]]]] = {
    "forward": _check_forward,
    "dkdv": _check_dkdv,
    "dq": _check_dq,
    "decode": _check_decode,
}
