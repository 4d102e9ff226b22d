"""Tile-config picker and overrides (normal process, no GPU needed)."""

import pytest

from numba_flash import AttentionInputError
from numba_flash.cuda import (HEAD_DIM_BUCKETS, TileOverride, all_tile_configs, head_dim_bucket, tile_config_for,
                              tile_config_override)
from numba_flash.cuda.host.config import (COMPUTE_CAPABILITIES, DYNAMIC_SMEM_KERNELS, KERNELS,
                                          MAX_ACCUMULATORS_PER_THREAD, STATIC_SMEM_LIMIT, WIDE_HEAD_DIM_BUCKETS,
                                          WIDE_MAX_ACCUMULATORS_PER_THREAD, FlashAttentionConfig, dtype_supported_on,
                                          head_dim_reason, smem_limit_for, storage_dtype, thread_grid)


def test_every_config_fits_and_splits():
    configs = all_tile_configs()
    assert {cfg.kernel for _, _, cfg in configs} == set(KERNELS)
    assert {cfg.head_dim_bucket for _, _, cfg in configs} == set(HEAD_DIM_BUCKETS)
    for cc, _, cfg in configs:
        assert cfg.problems(smem_limit_for(cc)) == [], cfg
        assert cfg.smem_bytes() <= smem_limit_for(cc)
        # Only the kernels that take a dynamic buffer go past 48 KiB, and only from sm_80 on.
        assert cfg.dynamic_smem == (cfg.smem_bytes() > STATIC_SMEM_LIMIT)
        assert not cfg.dynamic_smem or (cc >= (8, 0) and cfg.kernel in DYNAMIC_SMEM_KERNELS), (cc, cfg)
        wide = cfg.head_dim_bucket in WIDE_HEAD_DIM_BUCKETS
        assert cfg.accumulators_per_thread() <= (WIDE_MAX_ACCUMULATORS_PER_THREAD if wide
                                                 else MAX_ACCUMULATORS_PER_THREAD)
        # Head dims past 256: decode everywhere; the tiled kernels, the backward's too, from sm_80 on.
        assert not wide or cfg.kernel == "decode" or cc >= (8, 0), (cc, cfg)
    assert {(cc, cfg.kernel) for cc, _, cfg in configs if cfg.head_dim_bucket == 576} == {
        (cc, kernel) for cc in COMPUTE_CAPABILITIES for kernel in KERNELS if cc >= (8, 0) or kernel == "decode"}


@pytest.mark.parametrize("cc,tiles", [
    ((8, 0), {"forward": [(32, 32, 256), (16, 16, 128)], "backward_dkdv": [(16, 8, 128), (16, 8, 128)],
              "backward_dq": [(16, 8, 128), (16, 8, 128)]}),
    ((8, 6), {"forward": [(16, 16, 128), (16, 16, 128)], "backward_dkdv": [(16, 4, 64), (16, 2, 32)],
              "backward_dq": [(8, 8, 64), (8, 8, 64)]}),
    ((9, 0), {"forward": [(32, 32, 256), (32, 32, 256)], "backward_dkdv": [(16, 8, 128), (16, 8, 128)],
              "backward_dq": [(16, 8, 128), (16, 8, 128)]}),
])
def test_wide_head_dims_take_the_tiles_the_device_allows(cc, tiles):
    for kernel, want in tiles.items():
        for head_dim, (bm, bn, nt) in zip((300, 576), want):
            cfg = tile_config_for(head_dim, "float32", cc, smem_limit_for(cc), kernel)
            assert (cfg.block_m, cfg.block_n, cfg.threads) == (bm, bn, nt), (cc, kernel, head_dim)
            assert cfg.dynamic_smem and not cfg.problems(smem_limit_for(cc))
    assert tile_config_for(576, "float32", cc, smem_limit_for(cc), "decode").smem_bytes() <= STATIC_SMEM_LIMIT


def test_wide_head_dims_say_where_they_do_not_run():
    assert head_dim_reason(256, "forward", STATIC_SMEM_LIMIT) is None
    assert head_dim_reason(576, "decode", STATIC_SMEM_LIMIT) is None
    for kernel in DYNAMIC_SMEM_KERNELS:
        why = head_dim_reason(257, kernel, STATIC_SMEM_LIMIT)
        assert "48 KiB" in why and "compute capability >= 8.0" in why
        with pytest.raises(AttentionInputError, match="head dim 257 > 256"):
            tile_config_for(257, kernel=kernel)
    assert head_dim_reason(576, "forward", smem_limit_for((9, 0))) is None
    for kernel in ("backward_dkdv", "backward_dq"):
        for head_dim in (512, 513, 576):   # MLA's 576 too, within sm_86's 99 KiB
            assert head_dim_reason(head_dim, kernel, smem_limit_for((8, 6))) is None
    with pytest.raises(AttentionInputError, match="tc_forward kernel takes D <= 256"):
        tile_config_for(300, "float16", kernel="tc_forward")


def test_thread_shares_are_whole_runs_of_four():
    # 576 columns: 16 threads of 36 (9 runs of 4), never 64 of 9 or 32 of 18.
    assert thread_grid(16, 576, 256) == (16, 16)
    assert thread_grid(4, 576, 256) is None
    for cfg in (FlashAttentionConfig("backward_dkdv", 16, 8, 128, 576),
                FlashAttentionConfig("backward_dq", 8, 8, 64, 512)):
        assert (cfg.head_dim_bucket // cfg.score_split) % 4 == 0
    assert FlashAttentionConfig("backward_dkdv", 16, 8, 128, 576).score_split == 16
    # A backward tile with fewer (query, key) pairs than threads leaves threads nothing to sum.
    assert any("at least threads" in w for w in FlashAttentionConfig("backward_dq", 8, 8, 128, 512).problems(1 << 30))


def test_smem_limit_per_compute_capability():
    assert smem_limit_for((7, 5)) == STATIC_SMEM_LIMIT
    assert smem_limit_for((8, 0)) == 163 * 1024
    assert smem_limit_for((8, 6)) == smem_limit_for((8, 9)) == 99 * 1024
    assert smem_limit_for((9, 0)) == 227 * 1024


@pytest.mark.parametrize("cc,tiles", [
    ((7, 5), {"forward": (32, 8, 128), "backward_dkdv": (8, 8, 64), "backward_dq": (8, 8, 64)}),
    ((8, 0), {"forward": (32, 32, 128), "backward_dkdv": (16, 32, 256), "backward_dq": (32, 16, 128)}),
    ((8, 6), {"forward": (32, 32, 128), "backward_dkdv": (16, 16, 128), "backward_dq": (16, 16, 128)}),
    ((9, 0), {"forward": (32, 32, 128), "backward_dkdv": (16, 32, 256), "backward_dq": (32, 32, 256)}),
])
def test_d256_takes_the_bigger_tiles_the_device_allows(cc, tiles):
    for kernel, want in tiles.items():
        cfg = tile_config_for(256, "float32", cc, smem_limit_for(cc), kernel)
        assert (cfg.block_m, cfg.block_n, cfg.threads) == want, (cc, kernel)
        # 48 KiB (a GPU that refuses the opt-in) gives the static tiles back.
        static = tile_config_for(256, "float32", cc, STATIC_SMEM_LIMIT, kernel)
        assert not static.dynamic_smem and static.dynamic_smem_bytes() == 0
    # Other head dims keep their 48 KiB tiles, and so do the kernels without a dynamic buffer.
    for kernel in KERNELS:
        assert not tile_config_for(128, "float32", cc, smem_limit_for(cc), kernel).dynamic_smem
    assert not tile_config_for(256, "float16", cc, smem_limit_for(cc), "tc_forward").dynamic_smem


def test_an_override_past_48_kib_fits_only_the_kernels_with_a_dynamic_buffer():
    big = TileOverride(block_m=32, block_n=32, threads=128)
    assert tile_config_for(256, kernel="forward", smem_limit=227 * 1024, override=big).dynamic_smem
    with pytest.raises(AttentionInputError, match="shared memory"):
        tile_config_for(256, kernel="forward", override=big)   # the default limit is 48 KiB
    with pytest.raises(AttentionInputError, match="shared memory"):
        tile_config_for(256, kernel="tc_forward", smem_limit=227 * 1024,
                        override=TileOverride(block_m=64, block_n=64, threads=128))


@pytest.mark.parametrize("d", [1, 7, 16, 17, 33, 64, 65, 100, 128, 129, 200, 255, 256, 257, 400, 512, 513, 576])
def test_bucket_covers_head_dim(d):
    b = head_dim_bucket(d)
    assert b >= d and b in HEAD_DIM_BUCKETS
    smaller = [x for x in HEAD_DIM_BUCKETS if x < b]
    assert not smaller or max(smaller) < d
    for kernel in KERNELS:
        if not head_dim_reason(d, kernel, smem_limit_for((9, 0))):
            assert tile_config_for(d, "float32", (9, 0), smem_limit_for((9, 0)), kernel).head_dim_bucket == b
    with pytest.raises(AttentionInputError, match="between 1 and 576"):
        head_dim_bucket(577)


def test_smaller_smem_limit_falls_back():
    cfg = tile_config_for(256, "float32", smem_limit=24 * 1024)
    assert cfg.smem_bytes() <= 24 * 1024 and not cfg.problems(24 * 1024)


def test_override_context_and_validation():
    with tile_config_override(block_m=16, block_n=8, threads=32):
        cfg = tile_config_for(64)
        assert (cfg.block_m, cfg.block_n, cfg.threads) == (16, 8, 32)
    assert tile_config_for(64) != cfg
    with tile_config_override(block_m=128, block_n=128):
        with pytest.raises(AttentionInputError, match="shared memory"):
            tile_config_for(256)
    with pytest.raises(AttentionInputError, match="threads cannot split"):
        tile_config_for(16, override=TileOverride(block_m=1, block_n=1, threads=4))
    for bad in (0, 3, -8, 2.0, True):
        with pytest.raises(AttentionInputError):
            with tile_config_override(block_m=bad):
                pass


def test_bfloat16_configs_on_sm80_and_later_only():
    configs = all_tile_configs()
    ccs = ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0))
    assert {(cc, dt) for cc, dt, _ in configs} == {(cc, dt) for cc in ccs for dt in ("float32", "float16", "bfloat16")
                                                   if dt != "bfloat16" or cc >= (8, 0)}
    # Tiles live in float32 shared memory whatever the input dtype, so bfloat16 gets float16's configs.
    assert ({(cc, cfg) for cc, dt, cfg in configs if dt == "bfloat16"}
            == {(cc, cfg) for cc, dt, cfg in configs if dt == "float16" and cc >= (8, 0)})
    assert dtype_supported_on("bfloat16", (8, 0)) and dtype_supported_on("bfloat16", (12, 0))
    assert not dtype_supported_on("bfloat16", (7, 5))
    assert dtype_supported_on("float16", (7, 0)) and not dtype_supported_on("float64", (9, 0))
    assert storage_dtype("bfloat16") == "int16" and storage_dtype("float16") == "float16"
    with pytest.raises(ValueError, match="dtype"):
        storage_dtype("float64")


def test_the_tf32_kernels_slots_view_any_float32_layout_with_unit_stride_along_d():
    """The TF32 kernel copies K and V as 16-bit slots. numba-cuda's own ``view`` refuses an item-size change on a
    device array that is not C-contiguous, which a "bhsd" call's transposed (B, S, H, D) view never is: the slots
    view is built on the same memory instead (no GPU needed: only the array object is made)."""
    import numpy as np
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    from numba_flash.cuda.host.launch import async_copy_ok, slots

    class Allocation:   # stands in for the device memory of the caller's array
        device_ctypes_pointer = type("Pointer", (), {"value": 0x10000})()

    b, h, s, d = 2, 3, 8, 16
    # a C-contiguous (B, H, S, D) array seen as (B, S, H, D), as backends/cuda_io.py's _bshd gives the kernels
    bshd = DeviceNDArray((b, s, h, d), (h * s * d * 4, d * 4, s * d * 4, 4), np.float32, gpu_data=Allocation())
    with pytest.raises(ValueError):
        bshd.view(np.uint16)   # what the kernel's launch used to call
    assert async_copy_ok(bshd)
    got = slots(bshd)
    assert got.dtype == np.uint16 and got.shape == (b, s, h, 2 * d)
    assert got.strides == bshd.strides[:3] + (2,)
    assert got.device_ctypes_pointer.value == bshd.device_ctypes_pointer.value
