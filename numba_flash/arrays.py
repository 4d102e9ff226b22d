"""Duck-typed facts about array-like inputs, learnt without importing torch, cupy or numba.cuda.

Supported kinds: numpy arrays, torch tensors (any device), objects exporting ``__cuda_array_interface__``
(numba device arrays, CuPy) and objects exporting ``__dlpack__`` (JAX, CuPy, ...).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# DLPack device-type codes (dlpack.h): the ones an attention backend can tell apart.
_DLPACK_DEVICES = {1: "cpu", 2: "cuda", 3: "cpu", 10: "hip"}


def array_kind(x: Any) -> str | None:
    """'numpy', 'torch', 'cuda_array' (``__cuda_array_interface__``), 'dlpack', or None if ``x`` is no array."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if type(x).__module__.split(".")[0] == "torch" and hasattr(x, "data_ptr"):
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
        t = x.detach()
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
