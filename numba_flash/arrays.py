"""Duck-typed facts about array-like inputs, learnt without importing torch, cupy or numba.cuda.

Supported kinds: numpy arrays, torch tensors (any device), objects exporting ``__cuda_array_interface__``
(numba device arrays, CuPy) and objects exporting ``__dlpack__`` (JAX, CuPy, ...).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

# DLPack device-type codes (dlpack.h): the ones an attention backend can tell apart.
_DLPACK_DEVICES = {1: "cpu", 2: "cuda", 3: "cpu", 10: "hip"}


_tensor_type: Any = None   # torch.Tensor once torch is imported (a class that never changes after)


def _torch_tensor_type() -> Any:
    """``torch.Tensor`` when torch is imported, else None: no object can be a tensor before torch is imported, so
    this never imports it. (A half-initialised torch module may lack the attribute.) Asked several times a call:
    once found, the class is kept."""
    global _tensor_type
    if _tensor_type is None:
        torch = sys.modules.get("torch")
        _tensor_type = getattr(torch, "Tensor", None) if torch is not None else None
    return _tensor_type


def is_torch_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor, subclasses included (``nn.Parameter``, user subclasses), by type rather
    than by the name of the module that defined it."""
    tensor = _torch_tensor_type()
    return tensor is not None and isinstance(x, tensor)


def is_plain_torch_tensor(x: Any) -> bool:
    """Whether ``x`` is exactly a ``torch.Tensor`` (no subclass: not a Parameter, a MaskedTensor or a user's), asked
    without importing torch; one type lookup, for the checks every call makes on every argument."""
    tensor = _torch_tensor_type()
    return tensor is not None and type(x) is tensor


def is_host_float_tensor(x: Any) -> bool:
    """Whether ``x`` is a plain ``torch.Tensor`` on the CPU of float32 or float64 (the floating dtypes of 4 bytes or
    more), which ``numpy()`` views as it is (validated tensors: no lazy negation or conjugation bit). Asked of every
    array of a tiny call: no torch import, no dtype table."""
    if not is_plain_torch_tensor(x):
        return False
    dtype = x.dtype
    return dtype.is_floating_point and dtype.itemsize >= 4 and x.is_cpu   # is_cpu: 0.1 us, device.type 0.3-0.6


def host_tensor_view(x: Any) -> np.ndarray:
    """The numpy view of an ``is_host_float_tensor`` tensor: the same memory (detached first only where it requires
    grad, 0.4 us)."""
    return x.detach().numpy() if x.requires_grad else x.numpy()


def is_meta_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor on the meta device: shapes and dtypes, no values to read or memory to write."""
    return is_torch_tensor(x) and x.device.type == "meta"


def torch_result_type(x: Any) -> type:
    """The tensor type a torch operation on ``x`` returns: ``type(x)`` for a subclass that keeps torch's
    ``__torch_function__`` (its results stay that subclass), plain ``torch.Tensor`` for one that disables it
    (``nn.Parameter``: ``p * 2`` is a plain tensor, and an attention output should not be a parameter)."""
    import torch

    cls = type(x)
    if cls is torch.Tensor or getattr(cls, "__torch_function__", None) is torch._C._disabled_torch_function_impl:
        return torch.Tensor
    return cls


def as_result_kind(ref: Any, t: Any) -> Any:
    """``t``, a plain torch tensor computed for the torch tensor ``ref``, as the tensor type torch would return
    for ``ref`` (``as_subclass`` is a view: no copy)."""
    cls = torch_result_type(ref)
    return t if type(t) is cls else t.as_subclass(cls)


def as_plain_tensor(x: Any) -> Any:
    """``x`` (a numpy array or a torch tensor) as a plain ``torch.Tensor``, without copying where possible: numpy
    arrays become CPU tensors sharing their memory, tensors are detached and lose any subclass."""
    import torch
    import warnings

    if isinstance(x, np.ndarray):
        if any(s < 0 for s in x.strides):  # torch.from_numpy refuses negative strides
            x = np.ascontiguousarray(x)
        with warnings.catch_warnings():
            # A read-only array gives a warning about writes; nothing here writes to the inputs.
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(x)
    x = x.detach()
    # Compute on plain tensors: a subclass's __torch_function__ would run on every op of the blockwise loops.
    return x if type(x) is torch.Tensor else x.as_subclass(torch.Tensor)


def resolve_torch_bits(x: Any) -> Any:
    """A torch tensor with no lazy negation or conjugation pending (``x.conj().imag`` carries the negative bit,
    which ``numpy()``, ``__cuda_array_interface__`` and DLPack refuse); ``x`` itself when none is pending, else a
    materialised copy: the input is never modified."""
    if x.is_neg():
        x = x.resolve_neg()
    if x.is_conj():
        x = x.resolve_conj()
    return x


def array_kind(x: Any) -> str | None:
    """'numpy', 'torch', 'cuda_array' (``__cuda_array_interface__``), 'dlpack', or None if ``x`` is no array."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if is_torch_tensor(x):
        return "torch"
    # numba device arrays, real or simulated (the simulator's export no __cuda_array_interface__)
    if hasattr(x, "__cuda_array_interface__") or getattr(type(x), "__cuda_ndarray__", False) is True:
        return "cuda_array"
    if hasattr(x, "__dlpack__") and hasattr(x, "shape") and hasattr(x, "dtype"):
        return "dlpack"
    return None


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(x: Any) -> str:
    """Canonical dtype name: 'float32', 'float16', 'bfloat16', 'float64', 'int64', ..."""
    dt = x.dtype
    try:
        return _DTYPE_NAMES[dt]
    except (KeyError, TypeError):  # TypeError: a dtype object that cannot be hashed
        pass
    name = str(dt).rsplit(".", 1)[-1]  # torch.float32 -> float32
    name = {"half": "float16", "float": "float32", "double": "float64"}.get(name, name)
    try:
        # str(numpy dtype) costs microseconds, paid several times per call; dtype objects are few and immutable.
        _DTYPE_NAMES[dt] = name
    except TypeError:
        pass
    return name


def device_of(x: Any) -> str:
    """'cpu', 'cuda' or 'hip' (or a torch device type such as 'mps'). A HIP build of torch reports its tensors as
    'cuda'; the ROCm backend looks at ``torch.version.hip`` to tell the two apart."""
    kind = array_kind(x)
    if kind == "numpy":
        return "cpu"
    if kind == "torch":
        return x.device.type
    if kind == "cuda_array":
        return "cuda"
    if kind == "dlpack":
        try:
            dev_type, _ = x.__dlpack_device__()
        except Exception:  # an exporter without __dlpack_device__: assume host memory
            return "cpu"
        return _DLPACK_DEVICES.get(int(dev_type), f"dlpack-device-{int(dev_type)}")
    return "unknown"


def to_numpy(x: Any) -> np.ndarray:
    """A host numpy view or copy of ``x`` (a copy only where the data is not on the host or is bfloat16)."""
    kind = array_kind(x)
    if kind == "numpy":
        return x
    if kind == "torch":
        import torch

        t = x.detach()
        if type(t) is not torch.Tensor:  # a plain view: a subclass's __torch_function__ has no say in a host copy
            t = t.as_subclass(torch.Tensor)
        if t.layout != torch.strided:  # the backends refuse these (validation); the reference copies them anyway
            t = t.to_dense()
        t = resolve_torch_bits(t)
        if dtype_name(t) == "bfloat16":
            t = t.float()
        return t.cpu().numpy()
    if kind == "cuda_array":
        if hasattr(x, "copy_to_host"):
            return x.copy_to_host()
        if hasattr(x, "get"):  # CuPy
            return x.get()
    if kind == "dlpack" and device_of(x) == "cpu":
        return np.from_dlpack(x)
    return np.asarray(x)


def as_float64(x: Any) -> np.ndarray:
    """A float64 host copy of ``x``; never a view, so callers may scribble on it."""
    return np.array(to_numpy(x), dtype=np.float64, copy=True)
