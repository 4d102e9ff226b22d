"""How long one warp takes to issue a stretch of SASS when each instruction waits for its operands: the latency term
of the static performance model (``perf_model.py``), from register dependencies, no GPU.

A warp issues in order, at most one instruction per clock, and an instruction cannot issue before the registers it
reads are written (the scoreboard). So a warp's main-loop iteration takes at least the issue time of its stream
with those waits: ``run_cycles`` replays a straight stretch of instructions with every register ready at its start
and each result ready ``latency(instruction)`` clocks after its issue. Other warps on the same scheduler fill the
waits (that is the issue bound's business); no warp's iteration is shorter than its own replay, which is the
``latency`` bound the model adds beside the issue, warp and pipe bounds.

It is still a bound in the model's direction: it ignores what makes a real warp slower (bank conflicts, a busy pipe
delaying a ready instruction, the dependencies that cross from one stretch to the next, barrier waits,
instruction-cache misses) and assumes each result as early as the table below says.

Latencies (clocks from issue until a dependent instruction can issue) are round assumptions of this model,
one table for every compute capability it covers (7.5 to 9.0), in line with what public microbenchmarks of
Volta to Hopper report (fixed-latency ALU and FMA work 4 to 6, shared-memory loads 20 to 33, mma.sync about 30 to
35, shuffles 20 to 30): the model's figures move with them (``BENCHMARKS.md`` compares against measured kernels).
Global loads take the L2's latency, since the K/V tiles every block reads are shared by many blocks.
"""

from __future__ import annotations

import re
from typing import Iterable

from numba_flash.cuda.compile_check.sass import WGMMA_OPCODES, Instruction, hgmma_n

#: Clocks from issue until the result can be read, by ``sass.classify`` class.
CLASS_LATENCY: dict[str, int] = {
    "ffma": 4, "fp32": 4, "hfma2": 5, "imad": 5, "int": 5, "issue": 5, "conv": 14, "mufu": 18, "lds": 28,
    "ldg": 260, "local": 260, "hmma": 32, "sts": 1, "stg": 1, "bar": 1, "branch": 1,
}
#: Opcodes that differ from their class.
OPCODE_LATENCY: dict[str, int] = {"SHFL": 26, "S2R": 22, "S2UR": 22, "CS2R": 22, "LDSM": 30, "F2FP": 5}
#: A wgmma's result: a pipeline of about mma.sync's latency, then its 64 x N x 16 multiply-adds at the SM's dense
#: rate (sm_90: 2048 a clock, so N / 2 clocks): a chain of k steps into one accumulator takes their sum. An
#: assumption, as the table above; the wait (WARPGROUP.DEPBAR) is what the reading instructions wait behind.
HGMMA_PIPELINE = 30

# Opcodes that write no register (stores, barriers, branches, cp.async's copy).
_NO_DEST = frozenset({"STS", "STG", "ST", "STL", "RED", "BAR", "BRA", "BRX", "JMP", "EXIT", "RET", "CALL", "BSSY",
                      "BSYNC", "BREAK", "WARPSYNC", "NOP", "YIELD", "MEMBAR", "DEPBAR", "LDGSTS", "LDGDEPBAR",
                      "ERRBAR", "CCTL", "FENCE", "ARRIVES", "WARPGROUP", "UBLKCP"})
_REGISTER = re.compile(r"\b(U?R\d+|U?P\d)\b")


def latency(ins: Instruction) -> int:
    """Clocks after ``ins`` issues until a dependent instruction can issue."""
    if ins.base in WGMMA_OPCODES:
        return HGMMA_PIPELINE + hgmma_n(ins) // 2
    return OPCODE_LATENCY.get(ins.base, CLASS_LATENCY.get(ins.cls, 5))


def _widths(ins: Instruction) -> tuple[int, list[int]]:
    """(registers the destination spans, registers each source operand spans: 1 unless the opcode says)."""
    parts = ins.opcode.split(".")
    if ins.base == "HMMA":   # m16n8k16: A 4 registers, B 2, C and D 4 (float32) or 2 (float16); m16n8k8 half that
        acc = 4 if "F32" in parts else 2
        k16 = "16816" in parts
        return acc, [4 if k16 else 2, 2 if k16 else 1, acc]
    if ins.base in WGMMA_OPCODES:   # D and C: N / 2 float32 registers; A: a descriptor, or 4 registers
        acc = max(1, hgmma_n(ins) // 2)
        return acc, [1, acc] if "gdesc" in ins.operands.split(",")[1] else [4, 1, acc]
    if ins.cls in ("lds", "ldg", "local"):
        return max(1, ins.bits // 32), []
    if ins.cls in ("sts", "stg"):   # the data operand, last
        return 1, [-max(1, ins.bits // 32)]
    if ins.base == "IMAD" and "WIDE" in parts:
        return 2, []
    return 1, []


def _is_predicate(reg: str) -> bool:
    return reg.lstrip("U").startswith("P")


def _span(reg: str, n: int) -> list[str]:
    prefix = reg.rstrip("0123456789")
    first = int(reg[len(prefix):])
    return [f"{prefix}{first + i}" for i in range(n)]


def operand_registers(ins: Instruction) -> tuple[list[str], list[str]]:
    """(registers ``ins`` reads, registers it writes), from its operand text and guard predicate. The writes are
    the leading operands: the first, and the second where one of the two is a predicate (a compare's pair of
    predicates, a shuffle's in-bounds flag, an add's carry); none for a store, barrier or branch. RZ and PT are
    constants."""
    operands = [o.strip() for o in ins.operands.split(",")] if ins.operands else []
    dest_ops = 0 if ins.base in _NO_DEST or not operands else 1
    if dest_ops and len(operands) > 1 and (_is_predicate(operands[0]) or _is_predicate(operands[1])):
        dest_ops = 2
    dest_width, src_widths = _widths(ins)
    writes: list[str] = []
    for op in operands[:dest_ops]:
        m = _REGISTER.search(op)
        if m:
            writes += _span(m.group(1), 1 if _is_predicate(m.group(1)) else dest_width)
    reads: list[str] = [m.group(1) for m in _REGISTER.finditer(ins.predicate)]
    sources = operands[dest_ops:]
    for k, op in enumerate(sources):
        width = 1
        if src_widths and src_widths[0] < 0:
            width = -src_widths[0] if k == len(sources) - 1 else 1
        elif k < len(src_widths):
            width = src_widths[k]
        for j, m in enumerate(_REGISTER.finditer(op)):
            reads += _span(m.group(1), width if j == 0 and not _is_predicate(m.group(1)) else 1)
    return reads, writes


def run_cycles(instructions: Iterable[Instruction]) -> int:
    """Clocks one warp takes to issue ``instructions`` in order, one a clock at most, each once the registers it
    reads are ready (every register ready at the start; the last result's latency not counted)."""
    ready: dict[str, float] = {}
    return int(replay(list(instructions), ready, 0.0))


def replay(instructions: list[Instruction], ready: dict[str, float], clock: float) -> float:
    """Issue ``instructions`` in order from ``clock`` (the clock the first may issue at), each once the registers
    it reads are ready in ``ready`` (register -> clock; updated with what they write). Returns the clock the next
    instruction may issue at."""
    for ins in instructions:
        reads, writes = operand_registers(ins)
        at = max([clock] + [ready.get(r, 0.0) for r in reads])
        done = at + latency(ins)
        for r in writes:
            ready[r] = done
        clock = at + 1
    return clock


def iteration_cycles(stretches: list[tuple[bool, float, list[Instruction]]]) -> float:
    """Clocks one warp takes per main-loop iteration made of ``stretches`` in program order, each ``(looped,
    count, instructions)``: a straight stretch issues ``count`` (at most 1) times, a loop body ``count`` times in a
    row. Dependencies carry from stretch to stretch and from one iteration to the next: the iteration is replayed
    twice and the second one's clocks are the answer. A loop body is replayed twice as well, its second trip's
    clocks standing for each of the rest."""
    ready: dict[str, float] = {}
    clock = start = 0.0
    for _ in range(2):
        start = clock
        for looped, count, body in stretches:
            if count <= 0:
                continue
            before = clock
            clock = replay(body, ready, clock)
            if count < 1:   # a stretch some iterations skip (a remainder peeled off a loop): its share
                clock = before + (clock - before) * count
            elif looped and count > 1:
                trip = clock
                clock = replay(body, ready, clock)
                rest = (clock - trip) * (count - 2)   # the trips not replayed (negative: fewer than two)
                clock += rest
                if rest > 0:   # results still in flight arrive that much later
                    for r, t in ready.items():
                        if t > trip:
                            ready[r] = t + rest
    return clock - start
