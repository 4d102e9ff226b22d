"""Shared memory above 48 KiB: the per-kernel opt-in numba-cuda does not make, and the launch that needs it.

A block may declare at most 48 KiB of static shared memory (``cuda.shared.array(N, ...)``); ptxas refuses more.
Past that, a kernel takes its shared memory dynamically (``cuda.shared.array(0, ...)``, the size given as the
fourth element of the launch configuration), and the driver launches it with more than 48 KiB only once the
function's attribute ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` has been raised to that size, up to the
device's opt-in limit (``CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN``: 163 KiB on sm_80, 99 KiB on sm_86
and sm_89, 227 KiB on sm_90). numba-cuda 0.30 has no public call for it, but its function wrapper
(``numba.cuda.cudadrv.driver.CudaPythonFunction``, what ``_Kernel._codelibrary.get_cufunc()`` returns) carries the
``CUkernel`` handle and sets its carveout attribute with ``driver.cuKernelSetAttribute(attr, value, handle,
device_id)``; ``allow_dynamic_smem`` makes the same call with the size attribute.

Nothing here imports numba.cuda at module level, so the config and the tests can use it without a GPU.
"""

from __future__ import annotations

from typing import Any

from numba_flash.cuda.host.config import STATIC_SMEM_LIMIT

#: Names of the attributes in cuda-bindings' ``CUfunction_attribute`` and ``CUdevice_attribute`` enums.
FUNC_ATTRIBUTE = "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES"
DEVICE_OPTIN = "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"   # numba's Device reads CU_DEVICE_ATTRIBUTE_<name> lazily


def _numba_driver() -> tuple[Any, Any]:
    """numba-cuda's driver wrapper and the cuda-bindings driver module it calls (imported on first use)."""
    from numba.cuda.cudadrv.driver import binding, driver

    return driver, binding


def device_optin_limit(device: Any) -> int:
    """Bytes of shared memory one block of ``device`` (a numba ``Device``) may use with the opt-in; the 48 KiB
    static limit when the device cannot say (an old driver, the simulator)."""
    try:
        return max(STATIC_SMEM_LIMIT, int(getattr(device, DEVICE_OPTIN)))
    except Exception:
        return STATIC_SMEM_LIMIT


def allow_dynamic_smem(cufunc: Any, nbytes: int, driver: Any = None, binding: Any = None) -> bool:
    """Let the compiled kernel ``cufunc`` launch with ``nbytes`` of dynamic shared memory on its device.

    ``cufunc``: numba-cuda's compiled function (``handle``, ``device``), as ``_Kernel._codelibrary.get_cufunc()``
    returns it; ``driver`` and ``binding``: numba-cuda's driver wrapper and cuda-bindings' driver module (the
    defaults; a test passes fakes). Returns True when the launch may go ahead: ``nbytes`` within the 48 KiB every
    kernel gets without asking, or the attribute set. Returns False, having set nothing, when the attribute does
    not exist in these bindings, the device's opt-in limit is below ``nbytes``, or the driver refuses; the caller
    then runs a config that fits 48 KiB.
    """
    if nbytes <= STATIC_SMEM_LIMIT:
        return True
    if driver is None or binding is None:
        driver, binding = _numba_driver()
    attr = getattr(getattr(binding, "CUfunction_attribute", None), FUNC_ATTRIBUTE, None)
    try:   # numba's wrapper resolves driver calls lazily, and raises its own errors where there is no driver
        set_attribute = driver.cuKernelSetAttribute
    except Exception:
        set_attribute = None
    if attr is None or set_attribute is None:
        return False
    device = cufunc.device
    if device_optin_limit(device) < nbytes:
        return False
    try:
        set_attribute(attr, int(nbytes), cufunc.handle, device.id)
    except Exception:   # CudaAPIError: the driver said no, and the static config will serve
        return False
    return True


def launch(kernel: Any, grid: tuple[int, ...], threads: int, stream: Any, dynamic_bytes: int,
           args: tuple) -> bool:
    """Launch the numba-cuda dispatcher ``kernel`` with ``dynamic_bytes`` of dynamic shared memory (0: none).

    Above 48 KiB the attribute must be set on the very function that runs: the overload for these arguments' types,
    which ``Dispatcher.compile`` returns (loading it from the disk cache, host/kernel_cache.py, or compiling it) and
    the launch then picks, numba matching argument types exactly. ``Dispatcher.specialize`` would do the same
    through a fresh dispatcher, which has no disk cache. Launch callbacks may not call the driver, per numba-cuda's
    documentation, so the attribute is set here. Returns False, launching nothing, when ``allow_dynamic_smem``
    refuses; under the simulator (which has no attribute) it just launches.
    """
    from numba import config

    if dynamic_bytes <= STATIC_SMEM_LIMIT or config.ENABLE_CUDASIM:
        if dynamic_bytes:
            kernel[grid, threads, stream, dynamic_bytes](*args)
        else:
            kernel[grid, threads, stream](*args)
        return True
    compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
    if not allow_dynamic_smem(compiled._codelibrary.get_cufunc(), dynamic_bytes):
        return False
    kernel[grid, threads, stream, dynamic_bytes](*args)
    return True
