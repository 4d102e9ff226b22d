"""The latency term of the static performance model (numba_flash/cuda/perf_model/latency.py): which registers a SASS
instruction reads and writes, and the in-order replay of one warp's stream, on hand-written SASS whose timing is
worked out here from the latency table. The term on a compiled kernel: test_perf_model.py."""

import pytest

from numba_flash.cuda.perf_model.latency import (CLASS_LATENCY, OPCODE_LATENCY, iteration_cycles, latency,
                                                 operand_registers, run_cycles)
from numba_flash.cuda.compile_check.sass import parse


def _sass(*lines):
    """Instructions of nvdisasm-style text, one per line ("@P0 FADD R4, R5, R6" and the like)."""
    text = ".text.k:\n" + "\n".join(f"        /*{16 * i:04x}*/                   {line} ;"
                                     for i, line in enumerate(lines))
    return list(parse(text)[0].instructions)


FMA, HMMA, LDSM = CLASS_LATENCY["ffma"], CLASS_LATENCY["hmma"], OPCODE_LATENCY["LDSM"]


@pytest.mark.parametrize("line,reads,writes", [
    ("FFMA R2, R3.reuse, R4, R2", ["R3", "R4", "R2"], ["R2"]),
    ("ISETP.GE.AND P0, PT, R2, R3, PT", ["R2", "R3"], ["P0"]),                 # a compare writes predicates
    ("@!P1 FADD R4, R5, -R6", ["P1", "R5", "R6"], ["R4"]),                      # the guard is read
    ("SHFL.BFLY PT, R7, R4, 0x1, 0x1f", ["R4"], ["R7"]),                        # in-bounds flag, then the value
    ("IADD3 R2, P1, R3, R4, RZ", ["R3", "R4"], ["R2", "P1"]),                    # the carry is written
    ("LDS.128 R8, [R2+0x40]", ["R2"], ["R8", "R9", "R10", "R11"]),
    ("LDSM.16.M88.2 R16, [R3]", ["R3"], ["R16", "R17"]),
    ("STS.64 [R1+0x8], R6", ["R1", "R6", "R7"], []),                            # a store writes no register
    ("HMMA.16816.F32 R4, R12, R16, R4", ["R12", "R13", "R14", "R15", "R16", "R17", "R4", "R5", "R6", "R7"],
     ["R4", "R5", "R6", "R7"]),
    ("HMMA.16816.F16 R4, R12, R16, R4", ["R12", "R13", "R14", "R15", "R16", "R17", "R4", "R5"], ["R4", "R5"]),
    # wgmma: N / 2 float32 accumulators written and read; A from a descriptor (uniform registers) or 4 registers
    ("HGMMA.64x16x16.F32 R24, gdesc[UR4], R24, gsb0", ["UR4"] + [f"R{24 + i}" for i in range(8)],
     [f"R{24 + i}" for i in range(8)]),
    ("HGMMA.64x8x16.F32.BF16 R24, R56, gdesc[UR4].tnspB, R24, gsb0",
     ["R56", "R57", "R58", "R59", "UR4", "R24", "R25", "R26", "R27"], ["R24", "R25", "R26", "R27"]),
    # its 8-bit-float form (k32): the same registers
    ("QGMMA.64x16x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0", ["UR4"] + [f"R{24 + i}" for i in range(8)],
     [f"R{24 + i}" for i in range(8)]),
    ("QGMMA.64x8x32.F32.E5M2.E5M2 R24, R56, gdesc[UR4], R24, gsb0",
     ["R56", "R57", "R58", "R59", "UR4", "R24", "R25", "R26", "R27"], ["R24", "R25", "R26", "R27"]),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0", [], []),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", [], []),
    ("MOV R2, UR4", ["UR4"], ["R2"]),
])
def test_operand_registers(line, reads, writes):
    got_reads, got_writes = operand_registers(_sass(line)[0])
    assert sorted(got_reads) == sorted(reads) and got_writes == writes


def test_a_dependent_chain_waits_and_independent_work_issues_every_clock():
    chain = _sass(*["FFMA R2, R3, R4, R2"] * 8)
    assert run_cycles(chain) == 7 * FMA + 1
    independent = _sass(*[f"FFMA R{10 + i}, R3, R4, R{10 + i}" for i in range(8)])
    assert run_cycles(independent) == 8
    # Two chains interleaved hide half the latency each.
    two = _sass(*["FFMA R2, R3, R4, R2", "FFMA R5, R3, R4, R5"] * 4)
    assert run_cycles(two) == 3 * FMA + 2


def test_an_mma_waits_for_every_register_of_its_fragments():
    # The B fragment's second register comes from the second ldmatrix: the mma waits for it, then the next mma
    # for the accumulator.
    ins = _sass("LDSM.16.M88.4 R12, [R2]", "LDSM.16.M88.2 R16, [R2+0x100]",
                "HMMA.16816.F32 R4, R12, R16, R4", "HMMA.16816.F32 R4, R12, R16, R4")
    assert run_cycles(ins) == (1 + LDSM) + HMMA + 1
    assert latency(ins[2]) == HMMA and latency(ins[0]) == LDSM


def test_dependencies_carry_across_stretches_loop_trips_and_iterations():
    acc = _sass("FFMA R2, R3, R4, R2")
    # One FFMA into one accumulator, in a loop of 10 trips: each trip waits for the last.
    assert iteration_cycles([(True, 10.0, acc)]) == pytest.approx(10 * FMA)
    # The same FFMA written straight: replayed once per iteration, and the next iteration waits for it too.
    assert iteration_cycles([(False, 1.0, acc)]) == pytest.approx(FMA)
    # Independent work in a loop issues every clock.
    wide = _sass(*[f"FFMA R{10 + i}, R3, R4, R{10 + i}" for i in range(8)])
    assert iteration_cycles([(True, 5.0, wide)]) == pytest.approx(5 * 8)
    # A stretch after a loop waits for the loop's last result.
    use = _sass("FADD R5, R2, R6")
    carried = iteration_cycles([(True, 3.0, acc), (False, 1.0, use)])
    assert carried == pytest.approx(3 * FMA + 1)
    # A stretch that runs in half the iterations costs half its clocks.
    assert iteration_cycles([(False, 0.5, wide)]) == pytest.approx(4)
    # Nothing runs, nothing costs.
    assert iteration_cycles([(True, 0.0, wide)]) == 0


def test_a_chain_of_wgmmas_waits_for_each_ones_pipeline_and_multiply_adds():
    """Four k steps into one accumulator (Q K^T over D = 64), then a read of it: each waits for the one before,
    HGMMA_PIPELINE plus N / 2 clocks (the SM's 2048 multiply-adds a clock on a warpgroup's 64 x N x 16)."""
    from numba_flash.cuda.perf_model.latency import HGMMA_PIPELINE

    ins = _sass(*["HGMMA.64x64x16.F32 R24, gdesc[UR4], R24, gsb0"] * 4, "FMNMX R2, R24, R55, !PT")
    step = HGMMA_PIPELINE + 64 // 2
    assert latency(ins[0]) == step
    assert run_cycles(ins) == 4 * step + 1
    # QGMMA's 64 x N x 32 8-bit products at twice the 16-bit rate: the same clocks as HGMMA's 64 x N x 16
    q8 = _sass(*["QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0"] * 4, "FMNMX R2, R24, R55, !PT")
    assert q8[0].cls == "hgmma" and latency(q8[0]) == step and run_cycles(q8) == 4 * step + 1
