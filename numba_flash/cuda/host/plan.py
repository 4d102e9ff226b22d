"""Which kernels a call runs on, and why: the one place the choice is made, read by the entry points (flash.py),
which launch what it says, and by the backend's ``explain()``, which says it.

A call's forward runs on the TF32 kernel (float32 with ``precision="tf32"``), the tensor-core kernel (float16,
bfloat16) or the float32 SIMT kernel; its backward on the tensor-core pair or the SIMT pair. Each ``*_reason``
says why a call does not get the faster kernels (None when it does); the kernels' names come from their specs
(kernels/registry.py), looked up by role and kind.
"""

from __future__ import annotations

from numba_flash.cuda.host.config import (STATIC_SMEM_LIMIT, TC_BACKWARD_MAX_HEAD_DIM, TC_DTYPES, TC_MAX_HEAD_DIM,
                                          TC_MIN_COMPUTE_CAPABILITY, TF32_BIAS_MAX_HEAD_DIM, TF32_MAX_HEAD_DIM,
                                          head_dim_bucket)
from numba_flash.cuda.host.devices import compute_capability
from numba_flash.cuda.host.picker import TileOverride, active_override, tile_config_for
from numba_flash.cuda.kernels.registry import find, kernel_name
from numba_flash.errors import AttentionInputError


def forward_kernel(dtype: str, head_dim: int, override: TileOverride | None = None,
                   cc: tuple[int, int] | None = None, head_dim_v: int | None = None, precision: str = "ieee",
                   bias: bool = False, staged_mods: bool = False) -> str:
    """The forward kernel a call of ``dtype`` and head dims (``head_dim``, v's ``head_dim_v``) runs on, on a GPU of
    compute capability ``cc`` (the current one by default), under ``override`` (or the active
    ``tile_config_override``), with ``precision`` ("tf32" lets float32 run on TF32), attn_bias (``bias``) and
    mods whose values the tensor-core kernels stage in shared memory (``staged_mods``).
    Raises ``AttentionInputError`` where ``tensor_cores=True`` asks for what the call cannot have."""
    cc = compute_capability() if cc is None else cc
    if dtype == "float32" and precision == "tf32":
        return kernel_name("forward", "simt" if tf32_reason(head_dim, override, cc, head_dim_v, bias) else "tf32")
    why = tensor_core_reason(dtype, head_dim, override, cc, head_dim_v=head_dim_v)
    if why:
        return kernel_name("forward", "simt")
    wgmma_why = wgmma_reason(dtype, head_dim, override, cc, head_dim_v, staged_mods)
    return kernel_name("forward", "mma" if wgmma_why else "wgmma")


def wgmma_reason(dtype: str, head_dim: int, override: TileOverride | None = None,
                 cc: tuple[int, int] | None = None, head_dim_v: int | None = None,
                 staged_mods: bool = False) -> str | None:
    """Why a float16/bfloat16 forward on tensor cores runs on the mma.sync kernel rather than Hopper's wgmma one
    (tc_forward.py's WGMMA path); None when it runs on wgmma. The wgmma kernel serves only where
    ``tile_config_override(wgmma=True)`` asks for it (no GPU has timed it yet); then a reason is an
    ``AttentionInputError`` instead."""
    override, off = _override_in_force(override)
    if off:
        return off
    cc = compute_capability() if cc is None else cc
    spec = find("forward", "wgmma")
    widest = max(head_dim, head_dim_v or 0)
    if override is None or not override.wgmma:
        reason = "the wgmma forward runs only where tile_config_override(wgmma=True) asks for it (not timed yet)"
    elif dtype not in spec.dtypes:
        reason = f"{dtype} (the wgmma forward takes float16 and bfloat16)"
    elif tuple(cc) != spec.min_compute_capability:
        reason = f"wgmma exists on compute capability 9.0 only (sm_90a), this GPU is {cc[0]}.{cc[1]}"
    elif not 64 <= head_dim_bucket(widest) <= spec.max_head_dim:
        reason = f"head dim {widest}: the wgmma forward takes head dims 33 to {spec.max_head_dim}"
    elif staged_mods and head_dim_bucket(widest) > 64:
        # Q, K and V tiles take 48 KiB at D = 128: the mods' staged values do not fit beside them.
        reason = f"mods at head dim {widest}: their staged values do not fit beside the wgmma forward's tiles"
    else:
        reason = _override_misfit(override, (spec.name,), head_dim, dtype, cc)
    if reason and override is not None and override.wgmma:
        raise AttentionInputError(f"wgmma=True: {reason}")
    return reason


def backward_kernels(dtype: str, head_dim: int, override: TileOverride | None = None,
                     cc: tuple[int, int] | None = None, head_dim_v: int | None = None,
                     dbias: bool = False) -> tuple[str, str]:
    """The (dK/dV, dQ) kernels a backward runs on, arguments as ``forward_kernel``'s; ``dbias``: the call returns
    attn_bias's gradient."""
    why = tensor_core_reason(dtype, head_dim, override, cc, backward=True, dbias=dbias, head_dim_v=head_dim_v)
    kind = "simt" if why else "mma"
    return kernel_name("dkdv", kind), kernel_name("dq", kind)


def tensor_core_reason(dtype: str, head_dim: int, override: TileOverride | None = None,
                       cc: tuple[int, int] | None = None, backward: bool = False, dbias: bool = False,
                       head_dim_v: int | None = None) -> str | None:
    """Why a forward (or, with ``backward``, a backward; with ``dbias``, one that returns attn_bias's gradient)
    call runs on the float32 SIMT kernels rather than the tensor-core ones; None when it runs on tensor cores.
    ``head_dim_v``: v's head dim Dv when it differs from ``head_dim``. With ``override.tensor_cores`` True a reason
    is an ``AttentionInputError`` instead."""
    override, off = _override_in_force(override)
    if off:
        return off
    cc = compute_capability() if cc is None else cc
    reason = None
    if dtype not in TC_DTYPES:
        reason = f"{dtype} (the tensor-core kernels take float16 and bfloat16)"
    elif tuple(cc) < TC_MIN_COMPUTE_CAPABILITY:
        need = TC_MIN_COMPUTE_CAPABILITY
        reason = f"the tensor-core kernels need compute capability >= {need[0]}.{need[1]}, this GPU is {cc[0]}.{cc[1]}"
    elif max(head_dim, head_dim_v or 0) > TC_MAX_HEAD_DIM:
        reason = f"head dim {max(head_dim, head_dim_v or 0)} > {TC_MAX_HEAD_DIM} (the tensor-core kernels' largest)"
    elif backward and head_dim_v is not None and head_dim_v != head_dim:
        # The forward reads Dv from v's shape; the backward kernels' copies and stores take one head dim.
        reason = (f"v's head dim Dv={head_dim_v} differs from D={head_dim} (the tensor-core backward needs "
                  "Dv = D)")
    elif backward and dbias:
        reason = "attn_bias's gradient (return_dbias) is computed by the SIMT dQ kernel only"
    elif backward and head_dim > TC_BACKWARD_MAX_HEAD_DIM:
        reason = (f"head dim {head_dim} > {TC_BACKWARD_MAX_HEAD_DIM}: the tensor-core backward would hold more "
                  "accumulators than a thread has registers")
    else:
        roles = ("dkdv", "dq") if backward else ("forward",)
        kernels = tuple(kernel_name(role, "mma") for role in roles)
        reason = _override_misfit(override, kernels, head_dim, dtype, cc)
    if reason and override is not None and override.tensor_cores:
        raise AttentionInputError(f"tensor_cores=True: {reason}")
    return reason


def _override_in_force(override: TileOverride | None) -> tuple[TileOverride | None, str | None]:
    """The tile override that applies (``override``, else the active ``tile_config_override``) and, when it keeps
    every call off the tensor cores (``tensor_cores=False``), the reason to give."""
    override = override if override is not None else active_override()
    if override is not None and override.tensor_cores is False:
        return override, "tensor cores switched off by tile_config_override(tensor_cores=False)"
    return override, None


def _override_misfit(override: TileOverride | None, kernels: tuple[str, ...], head_dim: int, dtype: str,
                     cc: tuple[int, int]) -> str | None:
    """Why a tile override that names sizes does not fit ``kernels``; None when it fits or names none."""
    if override is None or (override.block_m, override.block_n, override.threads) == (None, None, None):
        return None
    why = []
    for kernel in kernels:
        cfg = override.apply(tile_config_for(head_dim, dtype, tuple(cc), kernel=kernel, override=TileOverride()))
        why += [f"{kernel}: {w}" for w in cfg.problems(STATIC_SMEM_LIMIT)]
    return f"the tile override {override} does not fit the tensor-core kernels: " + "; ".join(why) if why else None


def tf32_reason(head_dim: int, override: TileOverride | None = None, cc: tuple[int, int] | None = None,
                head_dim_v: int | None = None, bias: bool = False) -> str | None:
    """Why a float32 forward that allows TF32 (``precision="tf32"``) runs on the float32 SIMT kernel rather than
    the TF32 one (tf32_forward.py); None when it runs on TF32. ``head_dim_v``: v's head dim when it differs;
    ``bias``: the call has attn_bias. With ``override.tensor_cores`` True a reason is an ``AttentionInputError``
    instead, as in ``tensor_core_reason``."""
    override, off = _override_in_force(override)
    if off:
        return off
    cc = compute_capability() if cc is None else cc
    widest = max(head_dim, head_dim_v or 0)
    what = f"head dim {widest}" if widest == head_dim else f"v's head dim Dv={widest}"
    if tuple(cc) < TC_MIN_COMPUTE_CAPABILITY:
        need = TC_MIN_COMPUTE_CAPABILITY
        reason = f"TF32 needs compute capability >= {need[0]}.{need[1]}, this GPU is {cc[0]}.{cc[1]}"
    elif widest > TF32_MAX_HEAD_DIM:
        reason = f"{what} > {TF32_MAX_HEAD_DIM} (the TF32 kernel's largest)"
    elif bias and widest > TF32_BIAS_MAX_HEAD_DIM:
        reason = (f"attn_bias at {what} > {TF32_BIAS_MAX_HEAD_DIM} (its reads would spill the TF32 kernel's "
                  "registers)")
    else:
        reason = _override_misfit(override, (kernel_name("forward", "tf32"),), head_dim, "float32", cc)
    if reason and override is not None and override.tensor_cores:
        raise AttentionInputError(f"tensor_cores=True: {reason}")
    return reason
