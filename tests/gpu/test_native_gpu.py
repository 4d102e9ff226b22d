"""The cuda backend on a real NVIDIA GPU, against the float64 reference: the cases ``tools/gpu_check.py`` runs
(``tools/gpu_cases.py``), as tests. CI has no GPU, so they skip there, saying so; on a machine with one:

    pytest -m gpu -n 8 tests/gpu          # each case compiles its own kernels (about 20 s each on an H200)

Every case of 2026-11-27 passed on an H200 that day but one, MLA's head dims, which the cuda backend did not take
then (it does since fc3d1ca).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def _gpu_reason():
    from numba import config

    if config.ENABLE_CUDASIM:
        return "the CUDA simulator is on: these tests are for a real GPU"
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    if getattr(torch.version, "hip", None):
        return "a HIP GPU: the cuda backend is for NVIDIA GPUs"
    return None


if _gpu_reason():
    pytest.skip(_gpu_reason(), allow_module_level=True)

import gpu_check  # noqa: E402
import gpu_cases  # noqa: E402

CASES = [case for dtype in ("float32", "float16", "bfloat16") for d in (64, 128)
         for case in gpu_cases.dense_cases(dtype, d)]
EXTRA = [name for job in gpu_check.jobs("cuda") for name in job.get("extra", [])]


@pytest.fixture
def ctx(rng):
    return gpu_cases.Ctx("cuda", "cuda", int(rng.integers(2 ** 32)))


@pytest.mark.parametrize("name,case", CASES, ids=[c[0] for c in CASES])
def test_dense(ctx, name, case):
    result = case(ctx)
    assert result["ok"], result


@pytest.mark.parametrize("name", EXTRA)
def test_feature(ctx, name):
    result = gpu_check.extra_case(name)(ctx)
    assert result["ok"], result


def test_every_first_use_self_check_passed_in_this_process():
    from numba_flash.cuda import selfcheck

    failed = [v.reason for v in selfcheck.verdicts().values() if not v.passed]
    assert not failed
