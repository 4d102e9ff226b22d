"""``numba-flash warmup --cuda`` (numba_flash/cuda/compile_check/warm_cache.py): which specialisations it compiles,
and the command's lines, with the compile itself replaced (test_kernel_cache.py compiles for real)."""

from __future__ import annotations

import pytest


def test_the_jobs_follow_the_picker_per_compute_capability():
    from numba_flash.cuda.compile_check.warm_cache import DELTA, warm_jobs

    jobs = warm_jobs(((7, 5), (9, 0)), ("float16", "bfloat16", "float32"), (64, 128))
    assert len(jobs) == len(set(jobs))
    by_cc = {cc: {(j.label, j.dtype) for j in jobs if j.cc == cc} for cc in ((7, 5), (9, 0))}
    # sm_75: no bfloat16, no tensor-core kernels; sm_90: mma.sync for 16-bit data, SIMT for float32
    assert all(dtype != "bfloat16" and not label.startswith("tc_") for label, dtype in by_cc[(7, 5)])
    assert {("tc_forward", "bfloat16"), ("tc_backward_dq", "float16"), ("forward", "float32")} <= by_cc[(9, 0)]
    assert {(DELTA, "bfloat16"), ("decode", "float32"), ("decode_merge", "float16")} <= by_cc[(9, 0)]
    tiled = [j for j in jobs if j.cfg is not None]
    assert {j.causal for j in tiled} == {False, True}
    assert all(j.variant.has_right == j.causal and not j.variant.has_left for j in tiled)
    assert all(j.variant.async_copy == j.cfg.tensor_cores for j in tiled)
    assert {j.cfg.kernel for j in jobs if j.label == "decode"} == {"decode"}


def test_the_command_prints_a_line_per_kernel(monkeypatch, capsys, tmp_path):
    from numba_flash import cli
    from numba_flash.cuda.compile_check import warm_cache

    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(warm_cache, "compile_job", lambda job: (job, job.causal, 1.5))
    assert cli.main(["warmup", "--cuda", "--cc", "8.0", "--dtype", "float16", "--head-dim", "64", "--jobs", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"numba-flash warmup: 10 CUDA kernels into {tmp_path}"
    assert out[1] == "  [1/10] sm_80 tc_forward 64x32/128 float16 D=64 full: cached already"
    assert "  [5/10] sm_80 tc_forward 64x32/128 float16 D=64 causal: compiled in 1.5 s" in out
    assert "  [9/10] sm_80 backward_delta float16: cached already" in out
    assert out[-1] == "done: 4 compiled, 6 cached already"


@pytest.mark.parametrize("argv, message", [
    (["--cuda"], "expected --cc"),
    (["--cuda", "--cc", "7.0"], "cannot build for 7.0"),
    (["--cuda", "--cc", "8.x"], "expected versions"),
    (["--cuda", "--cc", "8.0", "--dtype", "float64"], "with --cuda expected some of"),
    (["--cuda", "--cc", "8.0", "--head-dim", "1024"], "from 1 to 256"),
])
def test_bad_arguments_are_named(capsys, argv, message):
    from numba_flash import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["warmup", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
