"""What the compile table (test_cuda_compile.py) does not say of the wgmma forward's builds: that their products
assemble to Hopper's HGMMA, Q K^T and P V (V N-major) at the tile's shapes, and that they need the "a" target
(plain sm_90 refuses them). Each build is one of the table's sm_90a jobs (compile_check.compile_jobs), compiled
here in full, so its row is checked against the compiler on every run too, not only when the table's sample
draws it.

Run: .venv/bin/python -m pytest -q -m ptx tests/numba_flash/cuda/test_wgmma_forward_compile.py
"""

from __future__ import annotations

import pytest

from numba_flash.cuda.compile_check import compile_jobs

pytestmark = pytest.mark.ptx

SM90A_JOBS = compile_jobs(((9, 0, "a"),))


def test_the_table_has_sm_90a_jobs():
    assert len(SM90A_JOBS) == 6 and {job[3] for job in SM90A_JOBS} == {((9, 0, "a"),)}


@pytest.mark.parametrize("kernel,cfg,dtype,targets", SM90A_JOBS,
                         ids=[f"{k}-{dt}-{cfg.head_dim_bucket}" for k, cfg, dt, _ in SM90A_JOBS])
def test_products_are_hgmma_on_sm_90a_only(kernel, cfg, dtype, targets):
    pytest.importorskip("cuda.bindings.nvjitlink")
    from numba_flash.cuda.compile_check import assemble, kernel_ptx
    from numba_flash.cuda.compile_check import table as compile_table
    from numba_flash.cuda.compile_check.sass import disassemble, link

    (target,) = targets
    ptx = kernel_ptx(kernel, cfg, dtype, target)
    found = assemble(ptx, kernel, cfg, dtype, target)
    table = compile_table.load()
    if table is not None and table.current():
        recorded = {(r.kernel, r.dtype, r.config, r.cc): r for r in table.rows}.get((kernel, dtype, cfg, target))
        assert found == recorded, f"the compiler says {found}, the table says {recorded}"
    assert not found.problems(), found
    sass = disassemble(link(ptx, target)[0])
    hgmma = [line for line in sass.splitlines() if "HGMMA." in line]
    assert any(f"HGMMA.64x{cfg.block_n}x16.F32" in line for line in hgmma), hgmma[:3]   # Q K^T
    d = cfg.head_dim_bucket
    assert any(f"HGMMA.64x{d}x16.F32" in line and "tnspB" in line for line in hgmma), hgmma[:3]   # P V, V N-major
    with pytest.raises(RuntimeError, match="sm_90"):   # why the rows carry the "a" target
        link(ptx, target[:2])
