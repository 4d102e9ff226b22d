"""A call's launches, planned once and replayed with new pointers: the thin launch path.

``build_plan`` takes the launches the dispatcher path made for one call (``launch_record.recording``) and the call's
arrays by name (q, k, v, out, lse, ...), and resolves once what numba's dispatcher works out on every launch: the
compiled kernel's handle, grid, block, dynamic shared memory, and every argument packed in numba's ABI
(``abi.ArgBuffer``). Each array argument is bound to the call array it lies in (by device address: a kernel's
arguments are views of the call's arrays, bfloat16 bits, a (B, S, H, D) view of a "bhsd" tensor, lse[:, :, 0], at
a fixed byte offset from it); what lies in none is a constant the plan keeps alive (the placeholders of switched-off
features). ``CallPlan.run`` then checks that the arrays match the plan (shape, strides, dtype, device, and the
16-byte alignment that chose a cp.async kernel) and, per launch, writes only their data pointers into the packed
buffer and calls ``cuLaunchKernel`` on the caller's stream: no ``__cuda_array_interface__``, no typing, no
argument flattening, no context query.

A plan is built for one kind of array: torch tensors (the hot path: ``data_ptr()``, ``shape``, ``stride()``,
``dtype``, ``device``), or anything else numba takes (``__cuda_array_interface__``, simulator arrays), read the slow
way. A launch the thin path cannot replay raises ``NotPlannable`` with the reason, for ``explain()``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from numba_flash.errors import AttentionInputError
from numba_flash.cuda.host.abi import DATA_FIELD, ARRAY_HEAD, ArgBuffer, array_values, slots_of
from numba_flash.cuda.host.driver_launch import launch as driver_launch


class NotPlannable(Exception):
    """The thin path cannot replay this call; ``str()`` says why (shown by ``explain()``). ``retry``: the next call
    of the signature may plan (what stood in the way may have been the first call's alone, e.g. a self-check)."""

    def __init__(self, reason: str, retry: bool = False):
        super().__init__(reason)
        self.retry = retry


def is_torch(x: Any) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch)."""
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def device_pointer(arr: Any) -> int:
    """Device address of a torch tensor, a numba device array, a simulator array (host memory underneath) or a
    ``__cuda_array_interface__`` exporter."""
    if is_torch(arr):
        return int(arr.data_ptr())
    host = getattr(arr, "_ary", None)
    if host is not None:
        return int(host.ctypes.data)
    pointer = getattr(arr, "device_ctypes_pointer", None)
    if pointer is not None:
        return int(pointer.value or 0)
    return int(arr.__cuda_array_interface__["data"][0])


@dataclass(frozen=True)
class ArraySig:
    """What a plan holds fixed about one call array: ``shape``, ``strides`` (elements for torch, bytes
    otherwise), ``dtype`` and ``device`` as the array's kind gives them, ``itemsize``, and ``aligned``: its data
    pointer was a multiple of 16 bytes when planned (a cp.async kernel may have been chosen for it)."""

    shape: tuple
    strides: tuple
    dtype: Any
    device: Any
    itemsize: int
    aligned: bool

    def describe(self) -> str:
        return (f"shape {tuple(self.shape)}, strides {tuple(self.strides)}, dtype {self.dtype} on {self.device}"
                + (", data 16-byte aligned" if self.aligned else ""))


def array_sig(x: Any) -> ArraySig:
    """``x``'s signature (torch tensors in torch's terms; other arrays in numpy's, strides in bytes)."""
    ptr = device_pointer(x)
    if is_torch(x):
        return ArraySig(tuple(x.shape), tuple(x.stride()), x.dtype, x.device, x.element_size(), ptr % 16 == 0)
    dtype = np.dtype(x.dtype)
    return ArraySig(tuple(int(n) for n in x.shape), tuple(int(s) for s in x.strides), dtype.str, "cuda",
                    dtype.itemsize, ptr % 16 == 0)


def _extent(sig: ArraySig) -> int:
    """Bytes from an array's data pointer to the end of its last element (0 for an empty array)."""
    if any(n == 0 for n in sig.shape):
        return 0
    unit = 1 if isinstance(sig.dtype, str) else sig.itemsize   # byte strides (numpy's terms) or element strides
    return sum((n - 1) * abs(s) for n, s in zip(sig.shape, sig.strides)) * unit + sig.itemsize


@dataclass
class KernelLaunch:
    """One planned launch: the compiled function's ``handle``, ``grid``, ``block``, dynamic ``shared`` bytes,
    its packed ``buffer``, ``bindings`` ((call array index, byte offset of the data pointer in the buffer, byte
    offset from the call array's pointer), ...), ``keep`` (the compiled kernel and the arrays bound to no call array:
    placeholders and workspace the buffer points at stay alive with the plan, while the first call's own arrays
    are not pinned by it), and ``name`` (the kernel's, for messages)."""

    handle: Any
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    buffer: ArgBuffer
    bindings: tuple[tuple[int, int, int], ...]
    keep: tuple
    name: str


def _is_array(x: Any) -> bool:
    return not isinstance(x, (int, float, bool, np.generic)) and hasattr(x, "shape") and hasattr(x, "dtype")


def _argtypes(record: Any) -> tuple:
    """The numba types the launch's kernel was compiled for (the simulator compiles nothing: typed here as
    numba types its arguments, arrays in any layout, which flattens the same)."""
    if record.compiled is not None:
        return tuple(record.compiled.argument_types)
    import numba
    from numba.core import types

    return tuple(types.Array(numba.from_dtype(np.dtype(a.dtype)), len(a.shape), "A") if _is_array(a)
                 else numba.typeof(a) for a in record.args)


def _scalar(value: Any, code: str) -> Any:
    """A scalar argument as ``struct`` packs it for ``code`` (numba's ctypes conversion: ints wrap, floats round)."""
    if code in "fd":
        return float(value)
    if code == "H" and isinstance(value, (float, np.floating)):
        return int(np.float16(value).view(np.uint16))
    bits = 8 * np.dtype(code).itemsize
    value = int(value) & ((1 << bits) - 1)
    return value - (1 << bits) if code in "bhiq" and value >> (bits - 1) else value


def _bind(pointer: int, starts: Sequence[int], extents: Sequence[int], what: str) -> tuple[int, int] | None:
    """(call array index, byte offset) of the call array that ``pointer`` lies in; None for none (a constant).
    Exactly equal pointers decide first; two call arrays that both hold it cannot be told apart at replay."""
    exact = [i for i, s in enumerate(starts) if s == pointer]
    if len(exact) > 1:
        raise NotPlannable(f"{what}: the call's arrays {exact} share one address; the thin path binds by address")
    if exact:
        return exact[0], 0
    inside = [i for i, (s, n) in enumerate(zip(starts, extents)) if s <= pointer < s + n]
    if len(inside) > 1:
        raise NotPlannable(f"{what}: lies in several of the call's arrays, which overlap")
    return (inside[0], pointer - starts[inside[0]]) if inside else None


def plan_launch(record: Any, starts: Sequence[int], extents: Sequence[int]) -> KernelLaunch | None:
    """A recorded launch as a ``KernelLaunch`` bound to the call arrays at ``starts`` (their extents in bytes);
    None when no argument lies in any call array (a launch of the self-check's own arrays, not the call's)."""
    compiled = record.compiled
    name = getattr(getattr(record.dispatcher, "py_func", None), "__name__", "kernel")
    if getattr(record, "problem", None):
        raise NotPlannable(f"{name}: {record.problem}")
    if compiled is not None and (getattr(compiled, "debug", False) or getattr(compiled, "cooperative", False)):
        raise NotPlannable(f"{name}: compiled with debug or as a cooperative kernel, which numba launches its way")
    if getattr(record.dispatcher, "extensions", None):
        raise NotPlannable(f"{name}: has argument extensions, which numba applies per launch")
    argtypes = _argtypes(record)
    buffer = ArgBuffer(slots_of(argtypes))
    values: list[Any] = []
    bindings = []
    constants: list[Any] = [compiled]   # what the plan keeps alive: the compiled kernel, the arrays bound to none
    for index, (value, ty) in enumerate(zip(record.args, argtypes)):
        if _is_array(value):
            pointer = device_pointer(value)
            values.extend(array_values(pointer, value.shape, value.strides, np.dtype(value.dtype).itemsize))
            bound = _bind(pointer, starts, extents, f"{name} argument {index}")
            if bound is not None:
                slot = len(values) - 2 * len(value.shape) - len(ARRAY_HEAD) + DATA_FIELD
                bindings.append((bound[0], buffer.offsets[slot], bound[1]))
            else:   # a placeholder or the call's workspace; the call's own arrays are not pinned by the plan
                constants.append(value)
        else:
            first = len(values)
            for slot in buffer.slots[first:first + len(slots_of((ty,)))]:
                values.append(_scalar(value, slot.code))
    buffer.pack(values)
    if not bindings:
        return None
    handle = compiled._codelibrary.get_cufunc().handle if compiled is not None else ("simulated", name)
    return KernelLaunch(handle, record.grid, record.block, record.shared, buffer, tuple(bindings),
                        tuple(constants), name)


class CallPlan:
    """The launches of one call signature, replayed with new arrays. ``names``: the call arrays in ``run``'s
    order; ``sigs``: what each must match; ``torch``: whether they are torch tensors (the fast checks)."""

    def __init__(self, names: Sequence[str], sigs: Sequence[ArraySig], launches: Sequence[KernelLaunch],
                 driver: Any, torch: bool):
        self.names = tuple(names)
        self.sigs = tuple(sigs)
        self.launches = tuple(launches)
        self.driver = driver
        self.torch = torch
        # (shape, strides, dtype, device index) per array, what the hot path compares
        self._expect = tuple((s.shape, s.strides, s.dtype, _device_index(s.device)) for s in self.sigs)
        self._aligned = tuple(s.aligned for s in self.sigs)
        self._lock = threading.Lock()   # one packed buffer per launch: two threads must not write it at once

    def _mismatch(self, index: int, x: Any) -> AttentionInputError:
        name, want = self.names[index], self.sigs[index]
        try:
            got = array_sig(x).describe()
        except Exception:
            got = f"{type(x).__name__}"
        return AttentionInputError(f"{name}: expected {want.describe()} as planned, got {got}")

    def pointers(self, arrays: Sequence[Any], count: int | None = None) -> list[int]:
        """The arrays' data pointers, having checked each against the plan; raises AttentionInputError naming the
        first that differs (another shape, strides, dtype or device, or lost alignment). ``count``: how many of
        the plan's arrays are given (the first ones; default all)."""
        count = len(self.names) if count is None else count
        if len(arrays) != count:
            raise AttentionInputError(f"arrays: expected {count} ({', '.join(self.names[:count])}), "
                                      f"got {len(arrays)}")
        ptrs = []
        if self.torch:
            # one comparison at a time, cheapest first; get_device() is an int (-1 on the CPU) where .device would
            # build a torch.device per call
            for i, x in enumerate(arrays):
                shape, strides, dtype, device = self._expect[i]
                try:
                    if (x.shape != shape or x.stride() != strides or x.dtype is not dtype
                            or x.get_device() != device):
                        raise self._mismatch(i, x)
                    p = x.data_ptr()
                except AttributeError:
                    raise self._mismatch(i, x) from None
                if p & 15 and self._aligned[i]:
                    raise self._mismatch(i, x)
                ptrs.append(p)
            return ptrs
        for i, x in enumerate(arrays):
            sig = array_sig(x)
            if sig != self.sigs[i] and not (sig == _aligned_twin(self.sigs[i]) and not self.sigs[i].aligned):
                raise self._mismatch(i, x)
            ptrs.append(device_pointer(x))
        return ptrs

    def unbound(self) -> str | None:
        """Why the plan cannot be trusted, or None: a call array bound to no launch argument was copied by the
        dispatcher path (a layout it cannot take in place), and replaying the copy's address would read stale
        data or write where nobody looks."""
        bound = {index for launch in self.launches for index, _, _ in launch.bindings}
        names = [name for i, name in enumerate(self.names) if i not in bound]
        if not names:
            return None
        return f"{', '.join(names)}: not passed to any kernel in place (the dispatcher path copied it)"

    def run(self, *arrays: Any, stream: Any = 0) -> None:
        """Launch the planned kernels on ``arrays`` (``names``' order) on ``stream`` (a CUstream or its integer
        handle; 0 the default stream). Writes only pointers; makes no synchronising driver call."""
        self._launch(self.pointers(arrays), stream)

    def run_new_outputs(self, *inputs: Any, outputs: int, stream: Any = 0) -> tuple:
        """``run`` with the last ``outputs`` arrays allocated here (torch plans: ``torch.empty_strided`` as
        planned, through torch's caching allocator) rather than passed and checked; returns them."""
        import torch

        count = len(self.names) - outputs
        ptrs = self.pointers(inputs, count)
        made = tuple(torch.empty_strided(s.shape, s.strides, dtype=s.dtype, device=s.device)
                     for s in self.sigs[count:])
        ptrs.extend(t.data_ptr() for t in made)
        self._launch(ptrs, stream)
        return made

    def _launch(self, ptrs: list[int], stream: Any) -> None:
        driver = self.driver
        with self._lock:
            for launch in self.launches:
                words = launch.buffer.words
                for index, offset, delta in launch.bindings:
                    words[offset >> 3] = ptrs[index] + delta   # data pointers: 8-byte slots at 8-aligned offsets
                driver_launch(driver, launch.handle, launch.grid, launch.block, launch.shared, stream,
                              launch.buffer.params_address)


def _device_index(device: Any) -> int:
    """A torch device as ``Tensor.get_device()`` gives it: its index on a GPU, -1 on the CPU."""
    if getattr(device, "type", "cpu") == "cpu":
        return -1
    return int(device.index or 0)


def _aligned_twin(sig: ArraySig) -> ArraySig:
    """``sig`` with ``aligned`` off: an array planned unaligned may come aligned (the plain-load kernel reads it)."""
    return ArraySig(sig.shape, sig.strides, sig.dtype, sig.device, sig.itemsize, True)


def build_plan(records: Sequence[Any], arrays: dict[str, Any], driver: Any) -> CallPlan:
    """The plan of the call whose launches are ``records``, its arrays ``arrays`` (name -> array, all torch
    tensors or none). Raises NotPlannable with the reason when a launch cannot be replayed."""
    transfers = getattr(records, "transfers", None)
    if transfers:   # a copy or memset a replay of the launches would leave out (or a first call's self-check)
        moved = ", ".join(sorted(set(transfers)))
        raise NotPlannable(f"the dispatcher path moved device memory during the call ({moved}), which launches "
                           f"alone do not replay", retry=True)
    names = tuple(arrays)
    values = tuple(arrays.values())
    torch = all(is_torch(x) for x in values)
    if not torch and any(is_torch(x) for x in values):
        raise NotPlannable("arrays: torch tensors and other arrays mixed")
    sigs = tuple(array_sig(x) for x in values)
    starts = tuple(device_pointer(x) for x in values)
    extents = tuple(_extent(s) for s in sigs)
    launches = [plan for r in records if (plan := plan_launch(r, starts, extents)) is not None]
    if not launches:
        raise NotPlannable("no launch of the call's arrays was recorded")
    return CallPlan(names, sigs, launches, driver, torch)


def record_plan(run: Any, arrays: dict[str, Any], driver: Any, execute: bool = True) -> tuple[CallPlan, Any]:
    """Run ``run()`` (the dispatcher path of one call, on ``arrays`` or views of them) while recording its
    launches, and plan them: (plan, what ``run`` returned). Raises NotPlannable as ``build_plan`` does, and when a
    call array is bound to no launch argument (``CallPlan.unbound``). ``execute=False`` (simulator only) records
    without running."""
    from numba_flash.cuda.host.launch_record import recording

    with recording(execute) as records:
        result = run()
    plan = build_plan(records, arrays, driver)
    unbound = plan.unbound()
    if unbound:
        raise NotPlannable(unbound)
    return plan, result
