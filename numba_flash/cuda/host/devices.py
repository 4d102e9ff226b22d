"""What the current device offers the picker: its compute capability, the shared memory a block may plan for, and
numba's id of it. Under the simulator: sm_90's, and device 0."""

from __future__ import annotations

from numba_flash.cuda.host.config import STATIC_SMEM_LIMIT, FlashAttentionConfig, smem_limit_for
from numba_flash.cuda.host.picker import TileOverride, tile_config_for
from numba_flash.cuda.host.smem import device_optin_limit
from numba_flash.cuda.kernels.registry import kernel_name


def compute_capability() -> tuple[int, int]:
    """The current device's compute capability; (9, 0) under the simulator or when it cannot be read."""
    from numba import config, cuda

    # The simulator's device claims 5.2, which describes no hardware: it runs whatever the kernels do.
    if config.ENABLE_CUDASIM:
        return (9, 0)
    try:
        cc = tuple(cuda.get_current_device().compute_capability)
        return (int(cc[0]), int(cc[1]))
    except Exception:  # the picker does not depend on cc today, so a guess is harmless
        return (9, 0)


def smem_limit() -> int:
    """Shared memory per block the picker may plan for on this device: ``config.smem_limit_for`` its compute
    capability, lowered to what the device itself says it opts in to (smem.py); 48 KiB where it cannot say. The
    simulator runs dynamic shared memory as it is, so it gets sm_90's limit."""
    from numba import config, cuda

    limit = smem_limit_for(compute_capability())
    if config.ENABLE_CUDASIM:
        return limit
    try:
        device = cuda.get_current_device()
    except Exception:
        return STATIC_SMEM_LIMIT
    return min(limit, device_optin_limit(device))


def configs_for(head_dim: int, dtype: str, override: TileOverride | None = None,
                kernels: tuple[str, ...] | None = None) -> dict[str, FlashAttentionConfig]:
    """Tile configs of ``kernels`` (registered names; the SIMT forward by default) for this device, by name; a bad
    override raises AttentionInputError."""
    cc, limit = compute_capability(), smem_limit()
    kernels = kernels if kernels is not None else (kernel_name("forward"),)
    return {kern: tile_config_for(head_dim, dtype, cc, limit, kern, override) for kern in kernels}


def current_device() -> int:
    """Id of numba's current GPU, which verdicts are kept under (0 under the simulator, which has one)."""
    from numba import config, cuda

    if config.ENABLE_CUDASIM:
        return 0
    return int(cuda.get_current_device().id)
