"""The static performance model: opcode classes, occupancy, and instruction counts on kernels whose SASS can be
predicted, then the model on a production kernel. Compiles with the real toolchain (numba-cuda[cu13], nvJitLink,
nvdisasm); no GPU. Run: .venv/bin/python -m pytest -q -m ptx tests/numba_flash/cuda/test_perf_model.py"""

import json

import pytest

pytestmark = pytest.mark.ptx


def _needs_toolchain():
    pytest.importorskip("numba.cuda")
    pytest.importorskip("cuda.bindings.nvjitlink")
    from numba_flash.cuda.compile_check.sass import nvdisasm_path

    try:
        nvdisasm_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("opcode,cls,bits", [
    ("FFMA", "ffma", 32), ("FFMA.FTZ", "ffma", 32), ("FMUL", "fp32", 32), ("FADD.FTZ", "fp32", 32),
    ("HFMA2.MMA", "hfma2", 32), ("HMMA.16816.F32", "hmma", 32), ("MUFU.EX2", "mufu", 32), ("F2F.F32.F16", "conv", 32),
    ("LDS.128", "lds", 128), ("LDS.U16", "lds", 16), ("LDSM.16.M88.4", "lds", 128), ("STS.64", "sts", 64),
    ("LDG.E.128.CONSTANT", "ldg", 128), ("LD.E", "ldg", 32), ("ST.E.U16", "stg", 16), ("STL.64", "local", 64),
    ("BAR.SYNC.DEFER_BLOCKING", "bar", 32), ("BRA", "branch", 32), ("IMAD.MOV.U32", "imad", 32),
    ("IMAD.WIDE.U32", "imad", 32), ("IADD3", "int", 32), ("LOP3.LUT", "int", 32), ("FMNMX", "int", 32),
    ("ISETP.GE.AND", "int", 32), ("S2R", "issue", 32), ("ULDC.64", "issue", 64),
])
def test_opcode_classes(opcode, cls, bits):
    from numba_flash.cuda.compile_check.sass import access_bits, classify

    assert classify(opcode) == cls
    assert access_bits(opcode) == bits


def test_occupancy_rules():
    from numba_flash.cuda.host.gpus import gpu_spec, occupancy

    a100, h100, t4 = gpu_spec((8, 0)), gpu_spec((9, 0)), gpu_spec((7, 5))
    # 128 threads, 64 registers: 8192 registers a block, 8 blocks by registers; 40 KiB + 1 KiB reserved a block:
    # 164 KiB / 41 KiB = 4 blocks by shared memory.
    occ = occupancy(a100, 128, 64, 40 * 1024)
    assert (occ.blocks_per_sm, occ.warps_per_sm, occ.limited_by) == (4, 16, "shared memory")
    # 168 registers round up to 5376 a warp, 21504 a block: 3 blocks by registers (65536 / 21504).
    occ = occupancy(h100, 128, 168, 10 * 1024)
    assert (occ.blocks_per_sm, occ.limited_by) == (3, "registers")
    # A T4 holds 32 warps: 256-thread blocks with few registers and no shared memory stop at 4.
    occ = occupancy(t4, 256, 16, 0)
    assert (occ.blocks_per_sm, occ.limited_by) == (4, "warps")
    # Too many resources: 1024 threads x 128 registers is twice an SM's register file.
    bad = occupancy(a100, 1024, 128, 0)
    assert not bad.launchable and "registers" in bad.limited_by
    assert not occupancy(t4, 128, 32, 70 * 1024).launchable


def _product_kernel_factory(rows_per_tile, cols, block_rows, threads, load_total):
    """A kernel shaped like ours: a main loop over runtime-many tiles; inside, a strided tile load (each thread
    stores range(t, load_total, threads) elements) and a register-blocked product of compile-time size."""
    from numba import cuda, float32

    RT, C, BR, NT, LT = rows_per_tile, cols, block_rows, threads, load_total
    LDC = C + 1   # padded row: numba needs the shape as constants

    def product_kernel(x, out, n_rows):
        t = cuda.threadIdx.x
        xs = cuda.shared.array((RT, LDC), float32)
        acc = cuda.local.array(BR, float32)
        for i in range(BR):
            acc[i] = float32(0.0)
        for n0 in range(0, n_rows, RT):
            cuda.syncthreads()
            for idx in range(t, LT, NT):
                xs[idx // C, idx % C] = x[n0 + idx // C, idx % C]
            cuda.syncthreads()
            for d in range(C):
                for i in range(BR):
                    acc[i] += xs[i, d] * xs[(t + i) % RT, d]
        for i in range(BR):
            out[t, i] = acc[i]

    return product_kernel


def _counts(py_func, threads, cc=(8, 0)):
    from numba import cuda, types

    from numba_flash.cuda.compile_check.lineinfo import helper_lines_in_their_files
    from numba_flash.cuda.perf_model.counts import dynamic_counts, loop_counts
    from numba_flash.cuda.compile_check.sass import disassemble, kernel_function, link, parse

    sig = types.void(types.float32[:, :], types.float32[:, :], types.int64)
    with helper_lines_in_their_files():   # as the model compiles (compile_check.kernel_ptx)
        ptx, _ = cuda.compile_ptx(py_func, sig, cc=cc, lineinfo=True)
    cubin, _ = link(ptx, cc, lineinfo=True)
    fn = kernel_function(parse(disassemble(cubin), keep_file=py_func.__code__.co_filename), py_func.__name__)
    return loop_counts(py_func, threads), dynamic_counts(fn, loop_counts(py_func, threads))


def test_counts_of_a_predictable_kernel():
    _needs_toolchain()
    # Per tile, every thread does C * BR = 32 * 4 multiply-adds (128 FFMA per warp, however ptxas unrolls the
    # d loop) and stores range(t, 80, 64) elements: 2 for lanes 0-15 and 1 for the rest, so warp 0 issues its
    # store loop twice and warp 1 once.
    fn = _product_kernel_factory(rows_per_tile=16, cols=32, block_rows=4, threads=64, load_total=80)
    lines, per_warp = _counts(fn, threads=64)
    assert len(per_warp) == 2
    assert [w["ffma"] for w in per_warp] == [128, 128]
    assert [w["sts"] for w in per_warp] == [2, 1]
    assert [w["bar"] for w in per_warp] == [2, 2]
    # Loads from global memory: one per stored element at least.
    assert per_warp[0]["ldg"] >= 2 and per_warp[1]["ldg"] >= 1
    for w in per_warp:
        assert w["total"] > w["ffma"] + w["sts"]


def test_counts_follow_the_tile_size():
    _needs_toolchain()
    # Twice the columns: twice the multiply-adds per tile, and a 512-element tile load over 64 threads is 8 stores
    # a thread (the compiler may unroll that loop; the count must not change).
    fn = _product_kernel_factory(rows_per_tile=16, cols=64, block_rows=4, threads=64, load_total=512)
    _, per_warp = _counts(fn, threads=64)
    assert [w["ffma"] for w in per_warp] == [256, 256]
    assert [w["sts"] for w in per_warp] == [8, 8]


def _rare_branch_kernel_factory():
    """The predictable kernel's shape (16 x 32 tile, 4 rows a thread, 64 threads) with a second, guarded product
    under ``if x_nonfinite:``, the kernels' branch for a tile holding an inf or a NaN."""
    from numba import cuda, float32, int32

    def rare_branch_kernel(x, out, n_rows):
        t = cuda.threadIdx.x
        xs = cuda.shared.array((16, 33), float32)
        acc = cuda.local.array(4, float32)
        for i in range(4):
            acc[i] = float32(0.0)
        for n0 in range(0, n_rows, 16):
            cuda.syncthreads()
            probe = float32(0.0)
            for idx in range(t, 512, 64):
                xs[idx // 32, idx % 32] = x[n0 + idx // 32, idx % 32]
                probe += xs[idx // 32, idx % 32] * float32(0.0)
            x_nonfinite = cuda.syncthreads_or(int32(probe != probe))
            if x_nonfinite:
                for d in range(32):
                    for i in range(4):
                        y = acc[i] + xs[i, d] * xs[(t + i) % 16, d]
                        acc[i] = y if n0 + i < n_rows else acc[i]
            else:
                for d in range(32):
                    for i in range(4):
                        acc[i] += xs[i, d] * xs[(t + i) % 16, d]
        for i in range(4):
            out[t, i] = acc[i]

    return rare_branch_kernel


def test_rare_branch_counts_as_not_taken():
    _needs_toolchain()
    # The guarded product's 128 FFMA per warp are not counted; the else branch's are, once, and so is the probe's
    # multiply-add per loaded element (8 per thread).
    lines, per_warp = _counts(_rare_branch_kernel_factory(), threads=64)
    assert [w["ffma"] for w in per_warp] == [128 + 8, 128 + 8]
    assert [w["sts"] for w in per_warp] == [8, 8]


def test_model_of_the_forward_kernel(model_cache_dir, monkeypatch):
    _needs_toolchain()
    from numba_flash.cuda.perf_model import main, run_model

    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(model_cache_dir))
    records = run_model(["forward"], ["float32"], [64], ["plain", "causal"], [(8, 0), (9, 0)])
    assert [(r.variant, r.cc) for r in records] == [("plain", "8.0"), ("plain", "9.0"), ("causal", "8.0"),
                                                    ("causal", "9.0")]
    for r in records:
        # The trip counts recovered from SASS account for exactly the tile's multiply-adds (2 * 64 * 32 * 64 per
        # block per key tile); the few FFMA of the softmax bookkeeping may add a little.
        assert 1.0 <= r.ffma_per_useful <= 1.02, r
        assert r.unit == "simt_fp32" and 0 < r.ceiling <= 1
        assert r.registers > 0 and r.spills == 0 and r.blocks_per_sm >= 1
        # Every useful multiply-add is an FFMA issue slot, so the issue bound caps the ceiling at the FFMA share
        # (x2 on sm_80, whose float32 pipe is half as wide as its issue rate).
        assert r.ceiling <= r.ffma_share * (2 if r.cc == "8.0" else 1) + 1e-3
        # Every shared-memory store instruction, counted by hand from the kernel (64 x 32 tiles, D = 64, 64
        # threads): the K^T and V tiles and the 64 x 32 scores into P^T, 4 elements per 128-bit store; and the row
        # pass, where each of the two warps stores for its 32 rows 32 probabilities and the max, sum and rescale
        # factor, one at a time.
        assert r.per_iteration["sts"] == (2 * 32 * 64 + 64 * 32) / (32 * 4) + 2 * (32 + 3), r.per_iteration
    plain = {r.cc: r for r in records if r.variant == "plain"}
    causal = {r.cc: r for r in records if r.variant == "causal"}
    # The causal variant does the same products (its mask work may be scheduled into fewer or more instructions).
    for cc in plain:
        assert causal[cc].per_iteration["ffma"] == pytest.approx(plain[cc].per_iteration["ffma"], rel=0.01)

    # The second run comes from the cache and agrees; the CLI prints the records as JSON with the documented keys.
    again = run_model(["forward"], ["float32"], [64], ["plain"], [(8, 0), (9, 0)])
    assert [r.ceiling for r in again] == [plain["8.0"].ceiling, plain["9.0"].ceiling]
    capsys_out = []
    monkeypatch.setattr("sys.stdout.write", lambda s: capsys_out.append(s) or len(s))
    assert main(["--json", "--kernel", "forward", "--dtype", "float32", "--head-dim", "64", "--variant", "plain",
                 "--cc", "9.0"]) == 0
    data = json.loads("".join(capsys_out))
    keys = {"kernel", "dtype", "cc", "head_dim", "variant", "unit", "ceiling", "registers", "smem_bytes",
            "warps_per_sm"}
    assert len(data) == 1 and keys <= set(data[0]) and data[0]["ceiling"] == plain["9.0"].ceiling


def test_model_of_the_backward_kernels(model_cache_dir, monkeypatch):
    _needs_toolchain()
    from numba_flash.cuda.host.picker import tile_config_for
    from numba_flash.cuda.perf_model import run_model

    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(model_cache_dir))
    records = {(r.kernel, r.cc): r for r in run_model(["backward"], ["float32"], [64], ["plain"], [(8, 0), (9, 0)])}
    dkdv, dq = tile_config_for(64, kernel="backward_dkdv"), tile_config_for(64, kernel="backward_dq")
    # The counts below are derived by hand from the kernels for a thread block of full warps whose score and
    # accumulator blocks hold runs of 4 (every store and load a 128-bit one).
    for cfg in (dkdv, dq):
        assert cfg.threads % 32 == 0 and cfg.block_m * cfg.block_n // cfg.threads >= 16, cfg
    d, warp_words = 64, 32 * 4            # words one warp moves with one 128-bit instruction
    for cc in ("8.0", "9.0"):
        r = records[("backward_dkdv", cc)]
        # Per query tile: the Q and dO tiles (block_m x D each), then P and dS (block_m x block_n each); and each
        # row's max and log2 sum, one 32-bit store each from the block's first block_m threads.
        row_terms = 2 * -(-dkdv.block_m // 32)
        assert r.per_iteration["sts.128"] == (2 * dkdv.block_m * d + 2 * dkdv.block_m * dkdv.block_n) / warp_words
        assert r.per_iteration["sts"] == r.per_iteration["sts.128"] + row_terms
        # Loads: S and dP read, per 4 head-dim columns, one word-run of each of a thread's score rows and columns;
        # dV and dK read, per query, the thread's key runs of P (dS) and its head-dim runs of dO (Q).
        (s_tr, s_tc), (g_tr, g_tc) = dkdv.score_grid, dkdv.kv_grid
        s_rows, s_cols = dkdv.block_m // s_tr, dkdv.block_n // s_tc
        g_keys, g_cols = dkdv.block_n // g_tr, d // g_tc
        per_thread = 2 * (s_rows + s_cols) * d // 4 + 2 * dkdv.block_m * (g_keys + g_cols) // 4
        assert r.per_iteration["lds.128"] == per_thread * dkdv.threads / 32
        # and its score rows' max and log2 sum, once a row, not once a score (32-bit loads)
        assert 0 < r.per_iteration["lds.32"] <= 2 * s_rows * dkdv.threads / 32
        assert r.per_iteration["lds"] == r.per_iteration["lds.128"] + r.per_iteration["lds.32"]
        # The four products' multiply-adds, plus one for each loaded Q and dO element (the non-finite probe) and a
        # few in the score epilogue.
        assert 1.0 <= r.ffma_per_useful <= 1.03, r
        r = records[("backward_dq", cc)]
        # Per key tile: the K and V tiles (block_n x D each), then dS^T (block_m x block_n).
        assert r.per_iteration["sts"] == r.per_iteration["sts.128"] == (2 * dq.block_n * d
                                                                        + dq.block_m * dq.block_n) / warp_words
        assert 1.0 <= r.ffma_per_useful <= 1.03, r
        both = records[("backward", cc)]
        assert 0 < both.ceiling < min(records[("backward_dkdv", cc)].ceiling, r.ceiling)


def _helper_loop_kernel_factory():
    """The predictable kernel's shape, its tile load written as a helper whose 64-pass loop the compiler keeps as a
    loop (the old backward loader's shape)."""
    from numba import cuda, float32

    def helper_loop_kernel(x, out, n_rows):
        t = cuda.threadIdx.x
        xs = cuda.shared.array((64, 65), float32)
        acc = cuda.local.array(4, float32)
        for i in range(4):
            acc[i] = float32(0.0)
        for n0 in range(0, n_rows, 64):
            cuda.syncthreads()
            load(xs, x, n0, t)
            cuda.syncthreads()
            for d in range(64):
                for i in range(4):
                    acc[i] += xs[i, d] * xs[(t + i) % 64, d]
        for i in range(4):
            out[t, i] = acc[i]

    # After the kernel: numba files an inlined helper's lines that come before the kernel's 'def' under the 'def'
    # line (lineinfo.py); the package's helpers live in other files.
    @cuda.jit(device=True, inline="always")
    def load(xs, x, n0, t):
        for idx in range(t, 4096, 64):
            xs[idx // 64, idx % 64] = x[n0 + idx // 64, idx % 64] * float32(2.0) + float32(1.0)

    return helper_loop_kernel


def test_a_helper_loop_counts_as_the_same_loop_written_in_the_kernel():
    """The helper's loop over range(t, 4096, 64) has a compile-time trip count for each lane (64) and one call per
    iteration: the model counts its 64 stores per warp, as for the loop inlined by hand (ptxas unrolls it; the
    stores say by how much). Copies of a helper line that ptxas peels off the loop count once more each (the
    kernel lines' remainder bookkeeping does not cover helper lines): a few stores over, not a multiple."""
    _needs_toolchain()
    _, helper = _counts(_helper_loop_kernel_factory(), threads=64)
    _, inline = _counts(_product_kernel_factory(rows_per_tile=64, cols=64, block_rows=4, threads=64,
                                                load_total=4096), threads=64)
    for h, i in zip(helper, inline):
        assert i["sts"] == 64 and 64 <= h["sts"] <= 64 + 4, (h, i)
        assert 64 <= h["ldg"] <= 1.1 * i["ldg"] + 4, (h, i)


def test_a_helper_loop_over_runtime_bounds_is_refused():
    _needs_toolchain()
    from numba import cuda, float32

    @cuda.jit(device=True, inline="always")
    def load(xs, x, n0, count):
        for idx in range(count):
            xs[idx % 64, 0] = x[n0 + idx % 64, 0] * float32(2.0)

    def runtime_loop_kernel(x, out, n_rows):
        t = cuda.threadIdx.x
        xs = cuda.shared.array((64, 65), float32)
        acc = float32(0.0)
        for n0 in range(0, n_rows, 64):
            cuda.syncthreads()
            load(xs, x, n0, n_rows - n0)
            cuda.syncthreads()
            for d in range(64):
                acc += xs[t % 64, d]
        out[t, 0] = acc

    with pytest.raises(ValueError, match="inlined helper"):
        _counts(runtime_loop_kernel, threads=64)


def test_the_dropout_variant_prices_philox_in_its_helper_loop(model_cache_dir, monkeypatch):
    """The tensor-core forward's keep mask comes from a loop inside a helper (tc_scores.make_keep_bits) that the
    compiler keeps rolled: the model takes its trip count from the helper's constants (N_TILES trips, one
    Philox-4x32-10 call each: 10 rounds of 2 multiplies) times the calls per iteration, so the variant is priced
    instead of refused: the same products, at least those multiplies more, a lower ceiling."""
    _needs_toolchain()
    from numba_flash.cuda.host.picker import tile_config_for
    from numba_flash.cuda.perf_model import run_model

    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(model_cache_dir))
    causal, dropout = run_model(["tc_forward"], ["float16"], [64], ["causal", "dropout"], [(8, 0)])
    cfg = tile_config_for(64, "float16", (8, 0), kernel="tc_forward")
    warps, n_tiles = cfg.threads // 32, cfg.block_n // 8
    assert dropout.per_iteration["hmma"] == causal.per_iteration["hmma"]
    philox_multiplies = warps * n_tiles * 10 * 2
    assert dropout.per_iteration["imad"] - causal.per_iteration["imad"] >= philox_multiplies
    assert dropout.ceiling < causal.ceiling


def test_helper_lines_keep_their_file():
    _needs_toolchain()
    # numba gives an inlined helper's instructions the kernel's file and the helper's line numbers, which can be a
    # line of the kernel's main loop; with line info for the model they carry the helper's own file.
    from numba import cuda, float32, types

    from numba_flash.cuda.device import masks
    from numba_flash.cuda.compile_check.lineinfo import helper_lines_in_their_files
    from numba_flash.cuda.compile_check.sass import disassemble, kernel_function, link, parse

    def finite_kernel(x, out, n):
        i = cuda.grid(1)
        if i < n:
            out[i] = masks.nan_if_not_finite(x[i] * float32(3.0))

    sig = types.void(types.float32[:], types.float32[:], types.int64)
    with helper_lines_in_their_files():
        ptx, _ = cuda.compile_ptx(finite_kernel, sig, cc=(8, 0), lineinfo=True)
    fn = kernel_function(parse(disassemble(link(ptx, (8, 0), lineinfo=True)[0])), "finite_kernel")
    files = {ins.source[0] for ins in fn.instructions if ins.source}
    assert masks.__file__ in files and __file__ in files, files


def test_model_counts_dynamic_shared_memory_in_the_occupancy(model_cache_dir, monkeypatch):
    """A config past 48 KiB declares no static shared memory (the assembler reports none of it), yet its dynamic
    buffer is what limits the blocks per SM: 32 x 32 / 128 forward at D = 256, 78,208 B, + 1 KiB the driver
    reserves per block, two blocks in sm_90's 228 KiB and in sm_80's 164 KiB."""
    _needs_toolchain()
    from numba_flash.cuda.host.config import smem_limit_for
    from numba_flash.cuda.host.picker import tile_config_for
    from numba_flash.cuda.perf_model import model_specialisation

    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(model_cache_dir))
    cfg = tile_config_for(256, "float32", (9, 0), smem_limit_for((9, 0)), "forward")
    assert (cfg.block_m, cfg.block_n, cfg.threads, cfg.dynamic_smem_bytes()) == (32, 32, 128, 78208)
    for r in model_specialisation("forward", "float32", 256, "plain", [(8, 0), (9, 0)]):
        assert r.tiles == "32x32" and r.smem_bytes >= 78208, r
        assert r.blocks_per_sm == 2 and r.spills == 0, r


def test_kernels_not_offered_at_a_head_dim_are_not_modelled():
    """Nothing is compiled for a specialisation the picker refuses: a head dim past 256 on sm_75 (48 KiB a block),
    the tensor-core forward past 256."""
    from numba_flash.cuda.perf_model import _model_or_none

    for kernel in ("backward_dkdv", "backward_dq"):
        assert _model_or_none(kernel, "float32", 576, "plain", [(7, 5)], [], True) == []
    assert _model_or_none("forward", "float32", 512, "plain", [(7, 5)], [], True) == []
    assert _model_or_none("tc_forward", "float16", 512, "plain", [(9, 0)], [(9, 0)], True) == []


def test_the_model_prices_latency_on_compiled_kernels(model_cache_dir, monkeypatch):
    """On the tensor-core forward at D = 128 (8 warps an SM on sm_90: two a scheduler to cover mma.sync, ldmatrix
    and shuffle chains) the replay binds, below the issue bound's ceiling; on every kernel it is at least the warp
    bound (an instruction a clock)."""
    _needs_toolchain()
    from numba_flash.cuda.perf_model import run_model

    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(model_cache_dir))
    (r,) = run_model(["tc_forward"], ["float16"], [128], ["plain"], [(9, 0)])
    assert r.bounds["latency"] >= r.bounds["warp"] and r.warps_per_sm == 8
    assert r.bound == "latency" and r.bounds["latency"] > r.bounds["issue"]
    without = r.ceiling * r.bounds["latency"] / max(v for k, v in r.bounds.items() if k != "latency")
    assert r.ceiling < without


def test_the_tf32_forward_is_priced_against_half_the_float16_tensor_peak(model_cache_dir, monkeypatch):
    """The TF32 kernel issues one m16n8k8 mma per 8 x 8 x 8 step of each product: per warp and key tile
    D/8 x N/8 for Q K^T and N/8 x D/8 for P V, counted here from the tile config alone. The dense TF32 peak is half
    the float16 one (each such mma has half the multiply-adds of an m16n8k16 and takes as long), so its ceiling is
    the useful multiply-adds over the bound's clocks times half the float16 peak."""
    _needs_toolchain()
    from numba_flash.cuda.host.picker import tile_config_for
    from numba_flash.cuda.host.gpus import gpu_spec
    from numba_flash.cuda.perf_model import run_model

    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(model_cache_dir))
    (r,) = run_model(["tf32_forward"], ["float32"], [64], ["plain"], [(8, 0)])
    cfg = tile_config_for(64, "float32", (8, 0), kernel="tf32_forward")
    warps, n_steps, d_steps = cfg.threads // 32, cfg.block_n // 8, cfg.head_dim_bucket // 8
    assert r.unit == "tensor_tf32" and r.per_iteration["hmma"] == warps * 2 * n_steps * d_steps
    useful = 2 * cfg.block_m * cfg.block_n * cfg.head_dim_bucket * r.blocks_per_sm
    peak = gpu_spec((8, 0)).tensor_fma / 2
    assert 0 < r.ceiling <= 1
    assert abs(r.ceiling - useful / (r.bounds[r.bound] * peak)) < 1e-3
    assert run_model(["tf32_forward"], ["float16"], [64], ["plain"], [(8, 0)]) == []   # float32 only
    assert run_model(["tf32_forward"], ["float32"], [64], ["plain"], [(7, 5)]) == []


def test_the_wgmma_forward_is_priced_by_its_multiply_adds(model_cache_dir, monkeypatch):
    """Each of a warpgroup's 4 warps issues every HGMMA (64 x N x 16): per key tile D / 16 of N = block_n for
    Q K^T and block_n / 16 of N = D for P V. Its tensor-pipe bound is the block's multiply-adds, counted here from
    the tile config alone, over the SM's dense rate; it is modelled on 9.0 only, compiled for sm_90a."""
    _needs_toolchain()
    from numba_flash.cuda.host.picker import tile_config_for
    from numba_flash.cuda.host.gpus import gpu_spec
    from numba_flash.cuda.perf_model import run_model

    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(model_cache_dir))
    (r,) = run_model(["wgmma_forward"], ["float16"], [64], ["plain"], [(8, 0), (9, 0)])
    cfg = tile_config_for(64, "float16", (9, 0), kernel="wgmma_forward")
    d, n, warps = cfg.head_dim_bucket, cfg.block_n, cfg.threads // 32
    assert r.kernel == "wgmma_forward" and r.cc == "9.0" and r.unit == "tensor" and r.spills == 0
    assert r.per_iteration["hgmma"] == warps * (d // 16 + n // 16)
    macs = 2 * cfg.block_m * n * d * r.blocks_per_sm
    assert r.bounds["tensor pipe"] == round(macs / gpu_spec((9, 0)).tensor_fma, 1)
    assert 0 < r.ceiling <= 1
    assert run_model(["wgmma_forward"], ["float16"], [256], ["plain"], [(9, 0)]) == []
