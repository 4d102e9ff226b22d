"""The arrays of one CUDA backend call: which GPU holds them, device views of them for the kernels, and results in
the caller's kind (``backends/cuda.py`` says which kinds come in and go out).

``Session`` is one call: it picks the GPU its inputs share (refusing inputs on different GPUs), copies host inputs
in where the backend is forced to take them, allocates outputs there and hands them back as the caller's kind.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

from numba_flash.arrays import as_result_kind, is_torch_tensor
from numba_flash.errors import AttentionInputError
from numba_flash.validation import AttentionCall


def is_numba_device_array(x: Any) -> bool:
    # Real and simulated numba device arrays both carry this class attribute; the simulated ones export no
    # __cuda_array_interface__, so the generic array-kind test sees them as host DLPack arrays.
    return getattr(type(x), "__cuda_ndarray__", False) is True


# By type, subclasses included (a name check on type(x).__module__ misses a user's torch.Tensor subclass).
_is_torch = is_torch_tensor


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "cupy"


def torch_bits(t: Any) -> Any:
    """``t`` as the kernels take it: a bfloat16 tensor viewed (zero-copy, any strides) as int16 bit patterns,
    since torch exports no bfloat16 through ``__cuda_array_interface__``; other dtypes unchanged."""
    import torch

    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


_DLPACK_CUDA = 2   # kDLCUDA in dlpack.h


def _pointer_device(ptr: int) -> int:
    """The ordinal of the GPU that owns device pointer ``ptr``, as the driver reports it (unified addressing makes
    every device pointer unique across GPUs)."""
    from cuda.bindings import driver as binding
    from numba.cuda.cudadrv.driver import driver

    attr = binding.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(driver.cuPointerGetAttribute(attr, binding.CUdeviceptr(ptr)))


def device_index(x: Any) -> int | None:
    """Index of the GPU holding ``x``; None for host memory (numpy, CPU tensors, simulated device arrays) or an
    array with no data pointer, which then run on numba's current device."""
    if isinstance(x, np.ndarray):
        return None
    if _is_torch(x):
        if x.device.type != "cuda":
            return None
        if x.device.index is not None:
            return int(x.device.index)
        import torch

        return int(torch.cuda.current_device())
    if _is_cupy(x):
        return int(x.device.id)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        # The pointer, not a numba array's context: an array wrapped with as_cuda_array carries the context that
        # was current when it was wrapped, which need not be the one that owns the memory.
        ptr = int(cai["data"][0])
        if not ptr:
            return None
        try:
            return _pointer_device(ptr)
        except Exception:  # memory the driver cannot place: a numba array's context is the best guess left
            context = getattr(getattr(x, "gpu_data", None), "context", None)
            return int(context.device.id) if context is not None else None
    if hasattr(x, "__dlpack_device__"):
        dev_type, dev_id = x.__dlpack_device__()
        return int(dev_id) if int(dev_type) == _DLPACK_CUDA else None
    return None


def bshd_view(arr: Any, layout: str) -> Any:
    """A (B, S, H, D) view of a numba device array in ``layout``, sharing its memory."""
    if layout == "bshd":
        return arr
    if hasattr(arr, "_ary"):  # simulator array: a numpy wrapper that transposes like numpy
        return arr.transpose((0, 2, 1, 3))
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    shape = tuple(arr.shape[i] for i in (0, 2, 1, 3))
    strides = tuple(arr.strides[i] for i in (0, 2, 1, 3))
    return DeviceNDArray(shape, strides, arr.dtype, stream=arr.stream, gpu_data=arr.gpu_data)


def dbias_like(bias: Any, dbias: Any, stream: Any) -> Any:
    """The float32 device gradient ``dbias`` (the bias's 4-dimensional shape) as the caller's bias is: same kind,
    device, dtype and shape."""
    shape = tuple(int(n) for n in bias.shape)
    if _is_torch(bias):
        import torch

        if bias.device.type == "cpu":
            return torch.from_numpy(dbias.copy_to_host(stream=stream)).reshape(shape).to(bias.dtype)
        # On the GPU: a copy of its own (numba owns dbias's memory), ordered after the kernels on torch's stream.
        return torch.as_tensor(dbias, device=bias.device).reshape(shape).to(bias.dtype, copy=True)
    host = np.asarray(dbias.copy_to_host(stream=stream)).reshape(shape)
    if isinstance(bias, np.ndarray):
        return host.astype(bias.dtype, copy=False)
    from numba import cuda

    return cuda.to_device(host.astype(np.dtype(str(bias.dtype)), copy=False), stream=stream)


def lead_axis(arr: Any) -> Any:
    """A (1,) + shape view of a numba device array, sharing its memory (numba's indexing takes no None). The
    packed-sequence driver views each sequence as a batch of one this way."""
    if hasattr(arr, "_ary"):  # simulator array: a numpy wrapper that indexes like numpy
        return arr[None]
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    shape, strides = tuple(arr.shape), tuple(arr.strides)
    return DeviceNDArray((1,) + shape, (shape[0] * strides[0],) + strides, arr.dtype, stream=arr.stream,
                         gpu_data=arr.gpu_data)


class Session:
    """Moves one call's arrays to numba device arrays and brings results back as the caller's array kind."""

    def __init__(self, call: AttentionCall):
        from numba import cuda

        self.cuda = cuda
        self.call = call
        self.ref = call.q
        self.stream = 0
        self.index = self._common_device(call)
        self.torch = _is_torch(self.ref) or (call.kind == "dlpack" and not is_numba_device_array(self.ref))
        # Host arrays are copied to the device and back: numpy always, torch CPU tensors under the simulator.
        self.host = call.kind == "numpy" or (call.kind == "torch" and call.device == "cpu")
        if self.torch:
            import torch

            dev = self.ref.device if _is_torch(self.ref) else None
            self.torch_device = dev
            if dev is not None and dev.type == "cuda":
                # numba ties a stream object to the context current when it is made: make it on the tensors' GPU.
                with self.on_device():
                    self.stream = cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)

    @staticmethod
    def _common_device(call: AttentionCall) -> int | None:
        """The index of the GPU every input is on (None: host inputs); AttentionInputError naming the first input
        found elsewhere. Checked before any work: a kernel on one GPU cannot read another's memory without peer
        access, and even with it the call would run at interconnect speed."""
        names = ("q", "k", "v") + (("dout", "out", "lse") if call.is_backward else ())
        first = None
        for name in names:
            index = device_index(getattr(call, name))
            if index is None:
                continue
            if first is None:
                first = (name, index)
            elif index != first[1]:
                raise AttentionInputError(f"{name}: expected an array on the GPU of {first[0]} (cuda:{first[1]}), "
                                          f"got one on cuda:{index}")
        return None if first is None else first[1]

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """Make the inputs' GPU numba's current device for the block, so allocations and launches happen there, with
        numba-cuda's low-occupancy warning off: a small call's grids are small (on the H200, every call of a few
        hundred rows warned "Grid size 20 will likely result in GPU under-utilization")."""
        from numba_flash.cuda.selfcheck import small_grids_unannounced

        with small_grids_unannounced():
            if self.index is None:
                yield
                return
            with self.cuda.gpus[self.index]:
                yield

    def device(self, x: Any, name: str) -> Any:
        """A numba device array for input ``x``, without copying unless ``x`` lives on the host."""
        cuda = self.cuda
        if self.host:
            # to_device needs contiguous data; the copy is of the host array, never a write to it.
            host = torch_bits(x.detach()).numpy() if _is_torch(x) else x
            return cuda.to_device(np.ascontiguousarray(host), stream=self.stream)
        if is_numba_device_array(x):
            return x
        if self.torch:
            import torch

            t = x if _is_torch(x) else torch.from_dlpack(x)
            if self.torch_device is None:
                self.torch_device = t.device
                self.stream = cuda.external_stream(torch.cuda.current_stream(t.device).cuda_stream)
            return cuda.as_cuda_array(torch_bits(t.detach()), sync=False)
        return cuda.as_cuda_array(x)

    def bias(self, call: AttentionCall) -> Any:
        """The call's attn_bias as the kernels take it, or None: a float32 device array of 4 dimensions with the
        broadcast ones kept at 1 (never expanded); zero-copy for a float32 GPU array, else one copy of the bias's
        own size."""
        if call.bias is None:
            return None
        arr, shape = call.bias.array, call.bias.shape
        if _is_torch(arr):
            return self.device(arr.detach().float().reshape(shape), "attn_bias")
        if isinstance(arr, np.ndarray):
            return self.device(np.asarray(arr, np.float32).reshape(shape), "attn_bias")
        dev = self.device(arr, "attn_bias")
        if str(dev.dtype) != "float32" or len(dev.shape) != 4:   # rare: another dtype or fewer dimensions
            host = np.asarray(dev.copy_to_host(stream=self.stream), np.float32).reshape(shape)
            dev = self.cuda.to_device(host, stream=self.stream)
        return dev

    def lse_in(self, x: Any) -> Any:
        """lse as a float32 numba device array (the forward's float32 lse passes through without a copy)."""
        if str(getattr(x, "dtype", "")).endswith("float32"):
            return self.device(x, "lse")
        if self.host:
            return self.cuda.to_device(np.ascontiguousarray(x, dtype=np.float32), stream=self.stream)
        if self.torch:
            return self.device(self._as_torch(x).float(), "lse")
        host = np.asarray(self.cuda.as_cuda_array(x).copy_to_host(), dtype=np.float32)
        return self.cuda.to_device(host, stream=self.stream)

    def _as_torch(self, x: Any) -> Any:
        import torch

        return x if _is_torch(x) else torch.from_dlpack(x)

    def empty(self, shape: tuple[int, ...], dtype: str) -> tuple[Any, Any]:
        """(what the caller gets back, the numba device array kernels write); for host calls the first is the
        dtype, and ``result`` makes the caller's array from the device one."""
        from numba_flash.cuda.host.config import storage_dtype

        if self.torch and not self.host:
            import torch

            t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.torch_device)
            return self._as_caller_kind(t), self.cuda.as_cuda_array(torch_bits(t), sync=False)
        arr = self.cuda.device_array(shape, dtype=np.dtype(storage_dtype(dtype)), stream=self.stream)
        if self.host:
            return dtype, arr
        if _is_cupy(self.ref):
            import cupy

            return cupy.asarray(arr), arr
        return arr, arr

    def result(self, user: Any, dev: Any) -> Any:
        if not self.host:
            return user
        arr = dev.copy_to_host(stream=self.stream)
        if self.torch:
            import torch

            return self._as_caller_kind(torch.from_numpy(arr).view(getattr(torch, user)))
        return arr

    def _as_caller_kind(self, t: Any) -> Any:
        """A result tensor as the tensor type torch returns for the caller's q (its subclass, see arrays.py)."""
        return as_result_kind(self.ref, t) if _is_torch(self.ref) else t

    def fill(self, arr: Any, value: float) -> None:
        """Set every element of the device array ``arr`` (any strides) to ``value`` on this call's stream. 0.0 is
        also the bit pattern of a bfloat16 zero, the only value filled into an int16 (bfloat16) array."""
        if hasattr(arr, "_ary"):  # simulator array
            arr[...] = value
        else:
            arr.setitem(slice(None), value, stream=self.stream)

    def finish(self) -> None:
        if self.host and self.stream:
            self.stream.synchronize()
