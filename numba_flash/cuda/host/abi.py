"""numba-cuda's kernel argument ABI, written down so that a launch can pack its arguments without numba's dispatcher.

numba-cuda 0.30 (``numba/cuda/dispatcher.py``, ``_Kernel._prepare_args``) passes a kernel's arguments to
``cuLaunchKernel`` flattened, one kernel parameter per field, in argument order:

- an array of ``ndim`` dimensions: ``meminfo`` (void*, 0), ``parent`` (void*, 0), ``nitems`` (intp), ``itemsize``
  (intp), ``data`` (void*), ``shape[0..ndim)`` (intp each), ``strides[0..ndim)`` (intp each, in bytes):
  ``5 + 2 * ndim`` parameters of 8 bytes;
- an integer: its own C type (``int64`` 8 bytes, ``int32`` 4, ``uint8`` 1, ...); ``boolean``: one byte;
- ``float32``: 4 bytes; ``float64``: 8; ``float16``: its 16 bits; ``complex64`` / ``complex128``: real then imaginary;
- a ``Record``: one pointer to a device copy (which numba makes per launch: the thin path refuses records);
- a tuple: its members, flattened in order; an enum member: its value.

``None`` and omitted arguments have no case there (numba raises ``NotImplementedError``): our kernels never take
them. The compiled kernel's ``.entry`` parameter list in its PTX has exactly these parameters; ``ptx_entry_params``
reads it back so that a test can hold ``slots_of`` to it for every registered kernel.

No numba.cuda import at module level: the numba types come in from the caller.
"""

from __future__ import annotations

import ctypes
import re
import struct
from dataclasses import dataclass
from typing import Any, Sequence

#: Fields of a flattened array before its shape and strides.
ARRAY_HEAD = ("meminfo", "parent", "nitems", "itemsize", "data")
#: Index of the data pointer among an array's fields.
DATA_FIELD = ARRAY_HEAD.index("data")

#: numba integer type name -> struct code (little-endian, standard sizes).
_INT_CODES = {"int8": "b", "uint8": "B", "int16": "h", "uint16": "H", "int32": "i", "uint32": "I",
              "int64": "q", "uint64": "Q"}


@dataclass(frozen=True)
class Slot:
    """One kernel parameter as the host writes it: ``code`` a ``struct`` code ('Q' pointers and 64-bit
    unsigned, 'q' int64, 'i' int32, 'f' float32, 'B' bool/uint8, ...), ``what`` a label for messages
    (``"arg 3 (array).data"``)."""

    code: str
    what: str

    @property
    def size(self) -> int:
        """Bytes of the parameter (its alignment too: every kernel parameter is naturally aligned)."""
        return struct.calcsize("<" + self.code)


def slots_of(argtypes: Sequence[Any]) -> list[Slot]:
    """The flattened kernel parameters of a kernel compiled for ``argtypes`` (numba types), in launch order, as
    ``_Kernel._prepare_args`` writes them. Raises ``NotImplementedError`` for a type numba cannot pass either."""
    from numba.core import types

    out: list[Slot] = []

    def add(ty: Any, label: str) -> None:
        if isinstance(ty, types.Array):
            out.extend(Slot("Q" if f in ("meminfo", "parent", "data") else "q", f"{label}.{f}") for f in ARRAY_HEAD)
            out.extend(Slot("q", f"{label}.shape[{i}]") for i in range(ty.ndim))
            out.extend(Slot("q", f"{label}.strides[{i}]") for i in range(ty.ndim))
        elif isinstance(ty, types.Boolean):
            out.append(Slot("B", label))
        elif isinstance(ty, types.Integer):
            out.append(Slot(_INT_CODES[str(ty)], label))
        elif ty == types.float16:
            out.append(Slot("H", label))           # numba passes a float16 as its bits
        elif ty == types.float32:
            out.append(Slot("f", label))
        elif ty == types.float64:
            out.append(Slot("d", label))
        elif ty in (types.complex64, types.complex128):
            code = "f" if ty == types.complex64 else "d"
            out.extend((Slot(code, f"{label}.real"), Slot(code, f"{label}.imag")))
        elif isinstance(ty, (types.NPDatetime, types.NPTimedelta)):
            out.append(Slot("q", label))
        elif isinstance(ty, types.Record):
            out.append(Slot("Q", label))
        elif isinstance(ty, types.BaseTuple):
            for i, member in enumerate(ty):
                add(member, f"{label}[{i}]")
        elif isinstance(ty, types.EnumMember):
            add(ty.dtype, label)
        else:
            raise NotImplementedError(f"{label}: numba-cuda passes no kernel argument of type {ty}")

    for index, ty in enumerate(argtypes):
        add(ty, f"arg {index} ({ty})")
    return out


def array_values(pointer: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> list[int]:
    """An array's flattened fields (``ARRAY_HEAD``, shape, strides) for a (shape) array at device address
    ``pointer`` with byte ``strides``: the values numba writes."""
    nitems = 1
    for n in shape:
        nitems *= int(n)
    return [0, 0, nitems, int(itemsize), int(pointer), *(int(n) for n in shape), *(int(s) for s in strides)]


class ArgBuffer:
    """Every parameter of one launch in one host buffer, each at a naturally aligned offset, and the array of
    pointers to them that ``cuLaunchKernel`` takes as ``kernelParams`` (the driver copies the values at launch,
    so the buffer may be rewritten for the next launch as soon as the call returns).

    ``pack(values)`` writes every parameter (one ``struct.pack_into``); ``put_pointer(offset, value)`` rewrites
    one 8-byte slot, the per-call work of a plan."""

    def __init__(self, slots: Sequence[Slot]):
        self.slots = tuple(slots)
        fmt, offsets, at = "<", [], 0
        for slot in self.slots:
            pad = -at % slot.size
            fmt += "x" * pad + slot.code
            at += pad
            offsets.append(at)
            at += slot.size
        self.offsets = tuple(offsets)
        self.nbytes = max(at, 8)
        self._struct = struct.Struct(fmt)
        # uint64 elements: the buffer itself 8-byte aligned, so every naturally aligned offset is aligned in memory
        self._raw = (ctypes.c_uint64 * ((self.nbytes + 7) // 8))()
        self.view = memoryview(self._raw).cast("B")
        #: the buffer as 8-byte words: ``words[offset >> 3] = pointer`` rewrites a data pointer (the hot path)
        self.words = self._raw
        base = ctypes.addressof(self._raw)
        self._params = (ctypes.c_void_p * max(1, len(self.slots)))(*(base + off for off in self.offsets))
        #: ``kernelParams`` for cuda.bindings' cuLaunchKernel: the address of the pointer array
        self.params_address = ctypes.addressof(self._params)

    def pack(self, values: Sequence[Any]) -> None:
        """Write every parameter; ``values`` one per slot, in order."""
        self._struct.pack_into(self.view, 0, *values)

    def put_pointer(self, offset: int, value: int) -> None:
        """Rewrite the 8-byte parameter at byte ``offset`` (a data pointer)."""
        struct.pack_into("<Q", self.view, offset, value)

    def tobytes(self) -> bytes:
        """The packed parameters, for comparisons in tests."""
        return bytes(self.view[:self.nbytes])


#: PTX parameter type -> bytes.
_PTX_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8}
_ENTRY = re.compile(r"\.entry\s+(\S+)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.([usbf])(8|16|32|64)\s+[\w$]+(?:\[(\d+)\])?")


def ptx_entry_params(ptx: str, entry: str | None = None) -> list[tuple[str, int]]:
    """The parameters of a kernel in PTX text: ``[(ptx type, bytes), ...]`` in order, for the ``.entry`` named
    ``entry`` or the first one. An aggregate ``.param .align A .b8 name[N]`` counts as ("b8[N]", N)."""
    for match in _ENTRY.finditer(ptx):
        if entry is not None and match.group(1) != entry:
            continue
        params = []
        for p in _PARAM.finditer(match.group(2)):
            _, kind, bits, count = p.groups()
            if count is not None:
                params.append((f"{kind}{bits}[{count}]", int(count) * _PTX_BYTES[bits]))
            else:
                params.append((f"{kind}{bits}", _PTX_BYTES[bits]))
        return params
    raise ValueError(f"ptx: no .entry {entry or ''} found")


#: struct code -> the PTX type letters numba's kernels declare for it (ints as u or s or b, floats as f).
_PTX_KINDS = {"f": "f", "d": "f"}


def ptx_mismatches(slots: Sequence[Slot], params: Sequence[tuple[str, int]]) -> list[str]:
    """Where ``slots`` (what the host packs) and ``params`` (the PTX entry's) disagree: count, then for each
    parameter its size, and float vs integer. Empty when they agree."""
    problems = []
    if len(slots) != len(params):
        problems.append(f"{len(slots)} packed parameters, {len(params)} in the PTX entry")
    for i, (slot, (ptx_type, nbytes)) in enumerate(zip(slots, params)):
        if slot.size != nbytes:
            problems.append(f"param {i} {slot.what}: packs {slot.size} bytes, PTX {ptx_type} has {nbytes}")
        elif (_PTX_KINDS.get(slot.code) == "f") != ptx_type.startswith("f"):
            problems.append(f"param {i} {slot.what}: packs '{slot.code}', PTX declares {ptx_type}")
    return problems
