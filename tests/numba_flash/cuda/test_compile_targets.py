"""The compile check's targets (numba_flash/cuda/compile_check/targets.py) without compiling anything: the wgmma
forward's jobs are assembled for sm_90a, from its spec, and no other kernel's are; ``--cc 9.0`` takes them in,
``--cc 9.0a`` takes them alone; a row of the "a" target reads its GPU's limits and names its target. Whether the
rows agree with the compiler is test_cuda_compile.py's part."""

from __future__ import annotations

import pytest

from numba_flash.cuda.compile_check import (MODS_HEAD_DIM, VARLEN_HEAD_DIM, KernelResources, compile_jobs,
                                            format_table, main)
from numba_flash.cuda.compile_check.targets import kernel_target, parse_target, target_label, target_name
from numba_flash.cuda.kernels.registry import REGISTRY, SPECS

SM90A = (9, 0, "a")


def _keys(jobs):
    return {(kernel, dtype, cfg.head_dim_bucket if cfg else None, cc) for kernel, cfg, dtype, ccs in jobs
            for cc in ccs}


#: The wgmma forward's rows: every switch on at each (dtype, bucket) of its spec, mods at D = 64 and packed
#: sequences at D = 128 (float16, as the mma.sync kernels' are).
WGMMA_ROWS = {("wgmma_forward", dt, b, SM90A) for dt in ("float16", "bfloat16") for b in (64, 128)} | {
    ("wgmma_forward+mods", "float16", MODS_HEAD_DIM, SM90A), ("wgmma_forward+varlen", "float16", VARLEN_HEAD_DIM,
                                                              SM90A)}


def test_the_hopper_target_is_the_one_hopper_kernels_compile_for():
    pytest.importorskip("numba.cuda")
    from numba_flash.cuda.device.hopper import ARCH

    assert kernel_target(REGISTRY["wgmma_forward"], (9, 0)) == ARCH == SM90A
    assert {kernel_target(spec, (9, 0)) for spec in SPECS if spec.kind != "wgmma"} == {(9, 0)}
    assert kernel_target(REGISTRY["wgmma_forward"], (8, 0)) is None
    assert kernel_target(REGISTRY["tc_forward"], SM90A) is None   # an "a" target selects the wgmma kernels alone


def test_9_0_takes_in_the_wgmma_rows_for_sm_90a():
    rows = _keys(compile_jobs(((9, 0),)))
    assert {r for r in rows if r[0].startswith("wgmma")} == WGMMA_ROWS
    assert {r[3] for r in rows if not r[0].startswith("wgmma")} == {(9, 0)}
    assert WGMMA_ROWS <= _keys(compile_jobs())   # the default: every compute capability


def test_9_0a_takes_the_wgmma_rows_alone_and_other_gpus_none():
    assert _keys(compile_jobs((SM90A,))) == WGMMA_ROWS
    assert _keys(compile_jobs(((9, 0), SM90A))) == _keys(compile_jobs(((9, 0),)))   # each row once
    assert not any(k.startswith("wgmma") for k, *_ in _keys(compile_jobs(((7, 5), (8, 0), (8, 6), (8, 9)))))
    with pytest.raises(ValueError, match=r"target 8\.0a: no kernel is built for it.*9\.0a"):
        compile_jobs(((8, 0, "a"),))


def test_mods_rows_follow_the_plan():
    """The wgmma forward's mods row is at D = 64 because the plan serves mods there and not at D = 128; the rows'
    ``staged_mods`` assumption holds for the sample mods."""
    pytest.importorskip("numba.cuda")
    from numba_flash.cuda.compile_check import sample_mods, served

    assert sample_mods().stages_tile
    assert served("wgmma_forward", "float16", 64, SM90A, mods=True)
    assert not served("wgmma_forward", "float16", 128, SM90A, mods=True)
    assert served("wgmma_forward", "float16", 128, SM90A)


def test_targets_read_and_print():
    assert [parse_target(t) for t in ("7.5", "9.0", "9.0a")] == [(7, 5), (9, 0), SM90A]
    assert [target_label(c) for c in ((7, 5), SM90A)] == ["7.5", "9.0a"]
    assert target_name(SM90A) == "sm_90a"
    for bad in ("9", "9.0b", "sm_90a"):
        with pytest.raises(ValueError):
            parse_target(bad)


def test_the_cli_refuses_targets_it_cannot_build(capsys):
    assert main(["--cc", "8.0a"]) == 2   # before compiling anything
    assert "no kernel is built for it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--cc", "9.0b"])


def test_an_sm_90a_row_reads_the_h100s_limits():
    cfg = next(cfg for kernel, cfg, dtype, ccs in compile_jobs((SM90A,)) if cfg.head_dim_bucket == 128)
    row = KernelResources("wgmma_forward", SM90A, "float16", cfg, 255, 8, 8, 0, 0, 50176, 0)
    plain = KernelResources("wgmma_forward", (9, 0), "float16", cfg, 255, 8, 8, 0, 0, 50176, 0)
    assert row.occupancy == plain.occupancy and row.occupancy.launchable
    assert row.declared_smem == 49152   # sm_90a reports sm_90's 1 KiB reservation too
    assert row.problems() == ["local memory: 8 B spill stores, 8 B spill loads, 0 B stack, 0 B lmem"]
    assert "wgmma_forward  9.0a   128" in format_table([row])
