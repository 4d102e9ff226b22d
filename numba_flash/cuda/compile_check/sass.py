"""SASS without a GPU: assemble PTX for a compute capability, disassemble it, and read it as instructions.

nvJitLink (cuda-bindings, from ``numba-cuda[cu13]``) assembles PTX into a cubin and logs each kernel's registers,
spills and shared memory; NVIDIA's ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel) prints the cubin's SASS with
the source line of every instruction when the PTX carries line info (``compile_ptx(..., lineinfo=True)``). This
module turns that text into ``Instruction`` records, sorts opcodes into the classes the performance model counts
and finds the loops (backward branches). Nothing here runs a kernel.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Iterable

# Opcode classes. The first match wins; the opcode's base name is what comes before the first '.'.
_CLASSES: tuple[tuple[str, frozenset[str]], ...] = (
    ("ffma", frozenset({"FFMA"})),
    ("fp32", frozenset({"FADD", "FMUL", "FFMA32I", "FADD32I", "FMUL32I"})),
    ("hfma2", frozenset({"HFMA2", "HADD2", "HMUL2", "HFMA2.MMA"})),
    ("hmma", frozenset({"HMMA", "IMMA", "DMMA"})),
    # wgmma: a warpgroup's 64 x N x 16 product, each of its 4 warps issuing one; N is in the opcode
    # (``hgmma_n``), which the parser leaves at "HGMMA.64" (the shape's lowercase x ends it). QGMMA is its 8-bit
    # float form, 64 x N x 32, which takes the same time (the 8-bit dense rate is twice the 16-bit one).
    ("hgmma", frozenset({"HGMMA", "QGMMA"})),
    ("mufu", frozenset({"MUFU"})),
    ("conv", frozenset({"F2F", "F2I", "I2F", "I2I", "FRND"})),
    ("lds", frozenset({"LDS", "LDSM"})),
    ("sts", frozenset({"STS"})),
    ("ldg", frozenset({"LDG", "LD", "LDC"})),
    ("stg", frozenset({"STG", "ST", "RED", "ATOM", "ATOMG"})),
    ("local", frozenset({"LDL", "STL"})),
    ("bar", frozenset({"BAR", "WARPSYNC", "MEMBAR", "DEPBAR", "WARPGROUP"})),
    ("branch", frozenset({"BRA", "BRX", "JMP", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "BREAK", "BPT", "YIELD"})),
    ("imad", frozenset({"IMAD", "IMUL", "IMAD32I", "IMUL32I"})),
)
#: Classes that run on the float32 pipe (the CUDA-core FMA units).
FP32_PIPE = frozenset({"ffma", "fp32", "hfma2"})
#: Opcodes that cost an issue slot and nothing else worth modelling (uniform datapath, moves between files).
_ISSUE_ONLY = frozenset({"NOP", "S2R", "S2UR", "CS2R", "R2UR", "UMOV", "ULDC", "UIADD3", "USEL", "UISETP", "ULOP3",
                         "USHF", "UIMAD", "ULEA", "UFLO", "UPOPC", "UPRMT", "USGXT", "ULDC.64", "VOTEU", "PLOP3",
                         "P2R", "R2P", "B2R"})

_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')
_FUNC = re.compile(r"^\.text\.([A-Za-z0-9_$.]+):\s*$")
_LABEL = re.compile(r"^(\.L_x_\d+):\s*$")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction: byte offset in its function, opcode with modifiers, operands, predicate, source line
    (file, line) of the innermost frame that is not an inlined helper of another file (None without line info),
    and the label it branches to."""

    offset: int
    opcode: str
    operands: str
    predicate: str
    source: tuple[str, int] | None
    target: str | None

    @property
    def base(self) -> str:
        return self.opcode.split(".", 1)[0]

    @property
    def cls(self) -> str:
        return classify(self.opcode)

    @property
    def bits(self) -> int:
        """Width of a memory access in bits (32 unless the opcode names another: .64, .128, .U16, LDSM .x4)."""
        return access_bits(self.opcode)


@dataclass(frozen=True)
class Function:
    name: str
    instructions: tuple[Instruction, ...]
    labels: dict[str, int]   # label -> index of the instruction it precedes

    def loops(self) -> list[tuple[int, int]]:
        """(first, last) instruction indices of every loop: a branch at ``last`` back to the label before
        ``first``. Sorted outermost first (by start, then by length, longest first)."""
        found = []
        for i, ins in enumerate(self.instructions):
            if ins.target is not None and ins.target in self.labels and self.labels[ins.target] <= i:
                found.append((self.labels[ins.target], i))
        return sorted(set(found), key=lambda ab: (ab[0], -(ab[1] - ab[0])))


def classify(opcode: str) -> str:
    """The model's class of an opcode: 'ffma', 'fp32', 'hfma2', 'hmma', 'mufu', 'conv' (float/int
    conversions), 'lds', 'sts', 'ldg' (global, generic and constant-bank loads), 'stg', 'local', 'bar', 'branch',
    'imad' (integer multiply-add, which ptxas also uses for moves and shifts because it runs on the FMA pipe),
    'issue' (uniform-datapath and special-register moves), or 'int' (the integer/logic ALU: adds, shifts,
    compares, selects, min/max)."""
    base = opcode.split(".", 1)[0]
    for name, opcodes in _CLASSES:
        if base in opcodes or opcode in opcodes:
            return name
    if base in _ISSUE_ONLY or opcode in _ISSUE_ONLY or base.startswith("U"):
        return "issue"
    return "int"


#: wgmma's SASS opcodes: 16-bit operands (HGMMA.64xNx16) and 8-bit floats (QGMMA.64xNx32).
WGMMA_OPCODES = ("HGMMA", "QGMMA")


def hgmma_n(ins: Instruction) -> int:
    """N of a wgmma (``HGMMA.64xNx16``, ``QGMMA.64xNx32``), whose shape the parser splits between the opcode
    ("HGMMA.64") and the operands ("xNx16.F32 R24, ..."); 0 for another instruction."""
    m = re.match(r"x(\d+)x\d+", ins.operands) if ins.base in WGMMA_OPCODES else None
    return int(m.group(1)) if m else 0


def access_bits(opcode: str) -> int:
    parts = opcode.split(".")
    if parts[0] == "LDSM":   # ldmatrix (LDSM.16.M88.4): 1, 2 or 4 8x8 16-bit matrices, 32 bits per lane each
        return 32 * int(parts[-1]) if parts[-1] in ("1", "2", "4") else 32
    for p in parts[1:]:
        if p in ("64", "128"):
            return int(p)
        if p in ("U8", "S8"):
            return 8
        if p in ("U16", "S16"):
            return 16
    return 32


def parse(text: str, keep_file: str | None = None) -> list[Function]:
    """Functions of ``nvdisasm -c -g`` output. ``keep_file``: attribute an instruction inlined from another file
    to the line of ``keep_file`` it was inlined at, so a kernel's helpers count towards the line that calls them."""
    functions: list[Function] = []
    name, insns, labels, source = None, [], {}, None

    def close() -> None:
        if name is not None:
            functions.append(Function(name, tuple(insns), dict(labels)))

    for raw in text.splitlines():
        line = raw.strip()
        m = _FUNC.match(line)
        if m:
            close()
            name, insns, labels, source = m.group(1), [], {}, None
            continue
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(insns)
            continue
        m = _LINE.search(line)
        if m:
            file, lineno, outer_file, outer_line = m.groups()
            if keep_file and file != keep_file and outer_file == keep_file:
                file, lineno = outer_file, outer_line
            source = (file, int(lineno))
            continue
        m = _INSN.match(raw)
        if m and name is not None:
            offset, pred, opcode, operands = m.groups()
            t = _TARGET.search(operands)
            insns.append(Instruction(int(offset, 16), opcode, operands.strip(), (pred or "").strip(), source,
                                     t.group(1) if t else None))
    close()
    return functions


def nvdisasm_path() -> str:
    """The ``nvdisasm`` executable: from the ``nvidia-cuda-nvdisasm`` wheel, else the PATH."""
    try:
        import nvidia

        for root in nvidia.__path__:
            for sub in ("cu13", "cu12", "cuda_nvdisasm", ""):
                cand = os.path.join(root, sub, "bin", "nvdisasm")
                if os.path.isfile(cand):
                    return cand
    except ImportError:
        pass
    found = shutil.which("nvdisasm")
    if not found:
        raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (part of the 'cuda' extra)")
    return found


def link(ptx: str, cc: tuple, lineinfo: bool = False) -> tuple[bytes, str]:
    """Assemble ``ptx`` for ``cc`` with nvJitLink: (cubin, verbose log with registers, spills and shared memory).
    ``cc`` is (major, minor) or (major, minor, suffix): (9, 0, "a") is sm_90a, whose wgmma and setmaxnreg plain
    sm_90 lacks (numba-cuda compiles for it on a 9.0 device)."""
    from cuda.bindings import nvjitlink

    arch = "".join(str(part) for part in cc)
    options = [f"-arch=sm_{arch}", "-verbose"] + (["-lineinfo"] if lineinfo else [])
    handle = nvjitlink.create(len(options), options)
    try:
        data = ptx.encode()
        try:   # ptxas runs in add_data (its errors show there: too much constant memory) or in complete
            nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel")
            nvjitlink.complete(handle)
        except Exception as exc:
            err = bytearray(nvjitlink.get_error_log_size(handle))
            nvjitlink.get_error_log(handle, err)
            raise RuntimeError(f"nvJitLink failed for sm_{arch}: {err.decode(errors='replace')}") from exc
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
    finally:
        nvjitlink.destroy(handle)
    return bytes(cubin), log.decode(errors="replace")


def disassemble(cubin: bytes) -> str:
    """``nvdisasm -c -g`` of a cubin: code sections only, with source-line comments."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([nvdisasm_path(), "-c", "-g", f.name], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {done.stderr.strip()}")
    return done.stdout


def kernel_function(functions: Iterable[Function], py_name: str) -> Function:
    """The kernel among a cubin's functions (numba mangles the Python name into it); helpers such as the
    slow path of a division are separate functions the kernel calls."""
    functions = list(functions)
    named = [f for f in functions if py_name in f.name]
    pool = named or functions
    if not pool:
        raise ValueError("no function in the disassembly")
    return max(pool, key=lambda f: len(f.instructions))
