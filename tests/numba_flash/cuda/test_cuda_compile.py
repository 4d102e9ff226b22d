"""Compile every CUDA kernel specialisation with the real compiler (numba-cuda -> PTX -> nvJitLink SASS) for sm_75,
sm_80, sm_86, sm_89 and sm_90 (and Hopper's wgmma forward for sm_90a), print the resource table, and fail on
spills, local memory, > 48 KiB static shared memory, float64 arithmetic, or a block that does not fit an SM of
that GPU. The kernels are the forward, the backward's three and decoding's two (the split-KV decode kernel and the
merge of its splits). Head dims are bucketed (16/32/64/128/256/512/576), so the table covers every D from 1 to
576; each kernel is compiled with both window bounds and softcap on, its most register-hungry variant, for float32,
float16 and bfloat16 (int16 bit arrays). PTX does not depend on the target, so each specialisation is lowered once
and assembled for each target.

While the kernels' code and the toolchain are those numba_flash/cuda/compile_table.json was recorded with, the
matrix is read from it and a random sample of it (SPOT_CHECK specialisations, seed printed) is compiled again and
must match it row for row; otherwise every specialisation is compiled (a quarter of an hour on two cores). Refresh
the table after changing a kernel: .venv/bin/python -m numba_flash.cuda.compile_check --write-table
Run: .venv/bin/python -m pytest -q -s -m ptx tests/numba_flash/cuda/test_cuda_compile.py"""

import functools
import os
import random
import warnings

import pytest

pytestmark = pytest.mark.ptx


def _needs_toolchain():
    pytest.importorskip("numba.cuda")
    pytest.importorskip("cuda.bindings.nvjitlink")


#: Specialisations of the recorded table compiled again on each run (about 10 s each on one core).
SPOT_CHECK = 6


@functools.lru_cache(maxsize=None)
def _all_rows() -> tuple:
    """Every specialisation's resources, in compile_jobs' order: the recorded table while it is current, after
    compiling SPOT_CHECK of its specialisations again (NUMBA_FLASH_SPOT_CHECK_SEED repeats a draw); otherwise a
    fresh compile of them all."""
    from numba_flash.cuda.compile_check import table as compile_table
    from numba_flash.cuda.compile_check import check_all, compile_jobs, run_jobs

    table = compile_table.load()
    if table is None or not table.current():
        warnings.warn("numba_flash/cuda/compile_table.json does not match the kernels' code or the toolchain: "
                      "compiling every specialisation (refresh it: python -m numba_flash.cuda.compile_check "
                      "--write-table)")
        return tuple(check_all())
    jobs = compile_jobs()
    by_key = {(r.kernel, r.dtype, r.config, r.cc): r for r in table.rows}
    # The table holds exactly the jobs' rows: nothing missing, nothing left over from a removed kernel.
    assert sorted(by_key, key=repr) == sorted(((k, dt, cfg, cc) for k, cfg, dt, ccs in jobs for cc in ccs), key=repr)
    seed = int(os.environ.get("NUMBA_FLASH_SPOT_CHECK_SEED") or random.SystemRandom().randrange(2**32))
    sample = random.Random(seed).sample(jobs, SPOT_CHECK)
    print(f"\ncompile table current; compiling again {SPOT_CHECK} of its {len(jobs)} specialisations "
          f"(NUMBA_FLASH_SPOT_CHECK_SEED={seed})")
    for fresh in run_jobs(sample):
        recorded = by_key[(fresh.kernel, fresh.dtype, fresh.config, fresh.cc)]
        assert fresh == recorded, f"seed {seed}: the compiler says {fresh}, the table says {recorded}"
    return tuple(by_key[(k, dt, cfg, cc)] for k, cfg, dt, ccs in jobs for cc in ccs)


def test_every_specialisation_compiles_without_spills():
    _needs_toolchain()
    from numba_flash.cuda.compile_check import (DBIAS_SUMS, DBIAS_SUMS_SUFFIX, MODS_HEAD_DIM, MODS_KERNELS,
                                                MODS_SUFFIX, VARLEN_HEAD_DIM, VARLEN_SUFFIX, format_table)
    from numba_flash.cuda.host.config import (COMPUTE_CAPABILITIES, HEAD_DIM_BUCKETS, KERNEL_DTYPES, KERNELS,
                                              TC_MAX_HEAD_DIM, TF32_MAX_HEAD_DIM, dtype_supported_on, head_dim_reason,
                                              smem_limit_for)

    results = list(_all_rows())
    print()
    print(format_table(results))
    bad = [(r.kernel, r.cc, r.dtype, r.config, r.problems()) for r in results if r.problems()]
    assert not bad, bad
    assert all(r.registers > 0 for r in results)   # the log was parsed
    # Every kernel (the decode kernel and its split merge included), head-dim bucket and dtype, bfloat16 included,
    # on every target.
    assert {"decode", "decode_merge"} <= {r.kernel for r in results}
    covered = {(r.cc, r.dtype, r.kernel, r.config.head_dim_bucket if r.config else None) for r in results}
    want = {(cc, dt, kern, b) for cc in COMPUTE_CAPABILITIES for dt in KERNEL_DTYPES
            for kern, buckets in [("backward_delta", [None]), ("decode_merge", [None]), ("dbias_sum", [None])]
            + [(k, HEAD_DIM_BUCKETS) for k in KERNELS]
            + [(k + DBIAS_SUMS_SUFFIX, HEAD_DIM_BUCKETS) for k in DBIAS_SUMS]   # a broadcast bias's gradient
            for b in buckets if dtype_supported_on(dt, cc)
            and not (b and head_dim_reason(b, kern.removesuffix(DBIAS_SUMS_SUFFIX), smem_limit_for(cc)))}
    # Head dims past 256: the decode kernel everywhere, the tiled ones from sm_80 on (the backward too).
    assert {(r.kernel, r.config.head_dim_bucket) for r in results if r.config and r.cc == (7, 5)
            and r.config.head_dim_bucket > 256} == {("decode", 512), ("decode", 576)}
    assert {r.kernel for r in results if r.config and r.cc == (8, 6) and r.config.head_dim_bucket == 576} == {
        "decode", "forward", "backward_dkdv", "backward_dq", "backward_dkdv+dbias-sums", "backward_dq+dbias-sums"}
    # The tensor-core forward, both copy paths, float16 and bfloat16, from sm_80 on.
    want |= {(cc, dt, kern, b) for cc in COMPUTE_CAPABILITIES if cc >= (8, 0) for dt in ("float16", "bfloat16")
             for kern in ("tc_forward", "tc_forward_loads") for b in HEAD_DIM_BUCKETS if b <= TC_MAX_HEAD_DIM}
    want |= {(cc, dt, kern, b) for cc in COMPUTE_CAPABILITIES if cc >= (8, 0) for dt in ("float16", "bfloat16")
             for kern in ("tc_backward_dkdv", "tc_backward_dkdv_loads", "tc_backward_dq", "tc_backward_dq_loads")
             for b in HEAD_DIM_BUCKETS if b <= 128}
    # The TF32 forward (float32 that allows it), both copy paths, from sm_80 on, up to D = 128.
    want |= {(cc, "float32", kern, b) for cc in COMPUTE_CAPABILITIES if cc >= (8, 0)
             for kern in ("tf32_forward", "tf32_forward_loads") for b in HEAD_DIM_BUCKETS if b <= TF32_MAX_HEAD_DIM}
    # The forward and both backward kernels again with user mods (compile_check.sample_mods), at head dim 64.
    mma = ("tc_", "tf32_")
    mods_kernels = {kern: dt for kern, dt in MODS_KERNELS.items() if not kern.startswith("wgmma")}
    want |= {(cc, dt, kern + MODS_SUFFIX, MODS_HEAD_DIM) for cc in COMPUTE_CAPABILITIES
             for kern, dt in mods_kernels.items() if cc >= (8, 0) or not kern.startswith(mma)}
    # And for packed sequences in one launch, at head dim 128.
    want |= {(cc, dt, kern + VARLEN_SUFFIX, VARLEN_HEAD_DIM) for cc in COMPUTE_CAPABILITIES
             for kern, dt in mods_kernels.items() if cc >= (8, 0) or not kern.startswith(mma)}
    # Hopper's wgmma forward, for sm_90a only (plain sm_90 rejects wgmma): every switch on at both of its buckets
    # in both dtypes, with mods at D = 64 (the plan refuses them at 128) and for packed sequences at D = 128.
    sm90a = (9, 0, "a")
    want |= {(sm90a, dt, "wgmma_forward", b) for dt in ("float16", "bfloat16") for b in (64, 128)}
    want |= {(sm90a, "float16", "wgmma_forward+mods", 64), (sm90a, "float16", "wgmma_forward+varlen", 128)}
    assert covered == want, want ^ covered
    # The T4 (7.5) through H100 (9.0), every one; bfloat16 from 8.0 on only.
    assert {r.cc for r in results} == {(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), sm90a}
    assert not any(r.dtype == "bfloat16" and r.cc < (8, 0) for r in results)
    # Every specialisation launches on every listed GPU: a block's registers and shared memory fit an SM.
    assert all(r.occupancy.launchable for r in results), [r for r in results if not r.occupancy.launchable]


def test_the_split_kv_merge_kernel_compiles_to_ptx():
    _needs_toolchain()
    from numba import cuda, float32

    from numba_flash.cuda.kernels.merge import merge_kernel

    out3, lse2 = float32[:, :, :], float32[:, :]
    ptx, _ = cuda.compile_ptx(merge_kernel().py_func, (out3, lse2, out3, lse2, out3, lse2), cc=(8, 0))
    assert ".entry" in ptx and "merge_states" in ptx
    assert ".local" not in ptx   # no local-memory arrays (spills show in SASS; this kernel holds none)


def test_sm90_reports_one_kib_more_shared_memory_than_declared():
    """What ``KernelResources.declared_smem`` relies on: the same PTX declaring 48 KiB of shared memory assembles
    for every target, and the report says 49152 B except on sm_90, which says 50176 B; with none declared, 0."""
    _needs_toolchain()
    from numba import cuda, float32, types

    from numba_flash.cuda.compile_check import KernelResources, parse_resources
    from numba_flash.cuda.compile_check.sass import link

    def uses_48_kib(a):
        s = cuda.shared.array(12288, float32)
        s[cuda.threadIdx.x] = a[0]
        cuda.syncthreads()
        a[cuda.threadIdx.x] = s[cuda.threadIdx.x + 1]

    def uses_none(a):
        a[cuda.threadIdx.x] += float32(1.0)

    for fn, declared in ((uses_48_kib, 49152), (uses_none, 0)):
        ptx, _ = cuda.compile_ptx(fn, types.void(types.float32[:]), cc=(7, 5))
        for cc in ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0)):
            smem = parse_resources(link(ptx, cc)[1])["smem"]
            assert smem == declared + (1024 if cc == (9, 0) and declared else 0), (fn.__name__, cc, smem)
            res = KernelResources("probe", cc, "float32", None, 16, 0, 0, 0, 0, smem, 0)
            assert res.declared_smem == declared


def _mods(**fns):
    from types import SimpleNamespace

    from numba_flash.cuda.device.user_mods import MOD_NAMES, cuda_mods

    return cuda_mods(SimpleNamespace(**{name: fns.get(name) for name in MOD_NAMES}))


def _forward_ptx_with(mods):
    from numba import cuda

    from numba_flash.cuda.compile_check import device_functions_for, kernel_signature
    from numba_flash.cuda.host.picker import TileOverride, tile_config_for
    from numba_flash.cuda.kernels.forward import make_forward_kernel

    cfg = tile_config_for(64, "float32", (8, 0), kernel="forward", override=TileOverride())
    kernel = make_forward_kernel(cfg, False, True, False, False, mods=mods)
    with device_functions_for((8, 0)):
        return cuda.compile_ptx(kernel.py_func, kernel_signature("forward", "float32"), cc=(8, 0))[0]


def test_a_mod_numba_cuda_cannot_build_is_named_in_the_error():
    """numba compiles it for the CPU (a str of an int), numba-cuda cannot: the launch's compile error becomes an
    AttentionInputError naming the mod and numba's reason."""
    _needs_toolchain()
    from numba_flash import AttentionInputError
    from numba_flash.cuda.host.launch import _compiling

    def needs_strings(b, h, q_idx, kv_idx):
        return len(str(q_idx)) <= len(str(kv_idx))

    mods = _mods(mask_mod=needs_strings)
    with pytest.raises(AttentionInputError, match=r"mask_mod=needs_strings: expected mods that numba-cuda can "
                                                  r"compile.*TypingError"):
        with _compiling(mods):
            _forward_ptx_with(mods)


def test_tables_past_the_constant_memory_are_named_in_the_error():
    """A mod's global array lands in the GPU's 64 KiB of constant memory, once per read in its source: a 48 KiB
    table read twice compiles to PTX, and the assembler refuses it; the error names the mod and says why."""
    _needs_toolchain()
    import numpy as np

    from numba_flash import AttentionInputError
    from numba_flash.cuda.host.launch import _compiling
    from numba_flash.cuda.compile_check.sass import link

    documents = np.repeat(np.arange(12, dtype=np.int64), 512)   # 48 KiB

    def same_document(b, h, q_idx, kv_idx):
        return documents[q_idx] == documents[kv_idx]

    mods = _mods(mask_mod=same_document)
    ptx = _forward_ptx_with(mods)
    with pytest.raises(AttentionInputError, match=r"mask_mod=same_document:.*64 KiB of constant memory.*"
                                                  r"too much global constant data"):
        with _compiling(mods):
            link(ptx, (8, 0))
    half = documents[::2].copy()     # 24 KiB, read twice: fits

    def same_half_document(b, h, q_idx, kv_idx):
        return half[q_idx] == half[kv_idx]

    assert link(_forward_ptx_with(_mods(mask_mod=same_half_document)), (8, 0))[0]


def test_dynamic_shared_memory_configs_compile_and_fit():
    """The configs past 48 KiB (the registry's wide_tiles, D = 256, float32, sm_80 on) with every switch on: no
    spills, no static shared array left beside the dynamic buffer, and a block of static plus dynamic shared memory
    that fits an SM (the compile check's rows for them; its full matrix test covers every dtype)."""
    _needs_toolchain()
    from numba_flash.cuda.compile_check import format_table, kernel_ptx
    from numba_flash.cuda.host.config import STATIC_SMEM_LIMIT
    from numba_flash.cuda.host.picker import all_tile_configs

    targets = {}
    for cc, dtype, cfg in all_tile_configs(((7, 5), (8, 0), (8, 6), (9, 0))):
        if cfg.dynamic_smem and dtype == "float32":
            targets.setdefault(cfg, []).append(cc)
    assert {cc for ccs in targets.values() for cc in ccs} == {(8, 0), (8, 6), (9, 0)}   # sm_75 stays static
    assert {cfg.kernel for cfg in targets} == {"forward", "backward_dkdv", "backward_dq"}
    rows = [r for r in _all_rows() if r.dtype == "float32" and r.config in targets and r.kernel == r.config.kernel
            and r.cc in targets[r.config]]
    assert sorted(repr((r.config, r.cc)) for r in rows) == sorted(repr((cfg, cc)) for cfg, ccs in targets.items()
                                                                  for cc in ccs)
    print()
    print(format_table(rows))
    for r in rows:
        assert not r.problems(), (r.config, r.cc, r.problems())
        assert r.dynamic_smem > STATIC_SMEM_LIMIT and r.declared_smem == 0, (r.config, r.cc, r.smem)
        assert r.occupancy.launchable and r.occupancy.blocks_per_sm >= 1
    # The PTX takes its tiles from the one dynamic (extern) buffer.
    cfg = next(c for c in targets if c.kernel == "forward")
    ptx = kernel_ptx("forward", cfg, "float32", (8, 0))
    shared = [line for line in ptx.splitlines() if ".shared" in line and line.lstrip().startswith(".")]
    assert shared and all(".extern" in line for line in shared), shared
