"""The tensor-core forward kernel (``numba_flash.cuda.kernels.tc_forward``) with two 16-row fragments per warp
(``FRAGMENTS = block_m / (16 * warps) = 2``: each K and V fragment loaded from shared memory feeds both fragments'
mma, each fragment with its own row statistics and accumulators), under the simulator, against the float64
reference on odd sizes, so that sequences end inside either fragment: every mask and variant the kernel takes,
Q in registers (F * D <= 128) and in shared memory (bucket 128), Dv != D, packed sequences and the non-finite rule.

Tiles: one warp of 32 rows (32 threads: the cheapest under the simulator, which runs a Python thread per CUDA
thread) and two warps of 32 rows each (64 threads), so that the second warp's rows start at 32, not 16.
Run: NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 .venv/bin/python -m pytest -q -m cudasim <this file>
"""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import attention_ref

pytestmark = pytest.mark.cudasim
torch = pytest.importorskip("torch")

from mods_cases import document_mods, soft_clip  # noqa: E402
from tc_sim_cases import BOUND, TORCH_DTYPE, forward, inputs, judge, naive_same_dtype, rel_l2  # noqa: E402

#: One warp owning rows 0-15 and 16-31; two warps owning 32 rows each.
F2_ONE_WARP = dict(block_m=32, block_n=16, threads=32, tensor_cores=True)
F2_ONE_WARP_32_KEYS = dict(block_m=32, block_n=32, threads=32, tensor_cores=True)
F2_TWO_WARPS = dict(block_m=64, block_n=16, threads=64, tensor_cores=True)

DOCS = np.repeat(np.arange(4), [11, 14, 1, 15])   # 41 keys in 4 documents
doc_mask, head_bias = document_mods(DOCS, 37, 41, blind_rows=2)


@pytest.fixture
def tc_configs(monkeypatch):
    """The tile configs the tensor-core forward was built for."""
    from numba_flash.cuda.kernels import tc_forward

    seen = []
    real = tc_forward.make_tc_forward_kernel

    def spy(cfg, *flags, **switches):
        seen.append(cfg)
        return real(cfg, *flags, **switches)

    monkeypatch.setattr(tc_forward, "make_tc_forward_kernel", spy)
    return seen


CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, tiles, kwargs)
    pytest.param(1, 45, 37, 2, 2, 16, F2_ONE_WARP, {}, id="plain-one-warp"),
    pytest.param(1, 53, 61, 2, 1, 16, F2_TWO_WARPS, dict(causal=True), id="causal-gqa-two-warps"),
    pytest.param(1, 41, 39, 1, 1, 24, F2_ONE_WARP_32_KEYS, dict(window_size=(7, 3)), id="window-32-keys"),
    pytest.param(1, 35, 58, 2, 1, 16, F2_TWO_WARPS,
                 dict(causal=True, softcap=2.5, alibi_slopes=np.array([0.6, 0.15], np.float32)),
                 id="causal-softcap-alibi"),
    pytest.param(1, 39, 33, 2, 2, 16, F2_ONE_WARP, dict(dropout_p=0.3, dropout_seed=2 ** 63 + 91), id="dropout"),
    # D = 40: bucket 64, the largest where two fragments keep Q's fragments in registers.
    pytest.param(1, 33, 47, 1, 1, 40, F2_ONE_WARP, dict(window_size=(20, -1), softmax_scale=0.3),
                 id="left-window-bucket64"),
]


@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,tiles,kw", CASES)
def test_two_fragments_against_the_reference(rng, tc_configs, b, sq, sk, hq, hkv, d, tiles, kw):
    (q, k, v), (q64, k64, v64) = inputs(rng, "float16", b, sq, sk, hq, hkv, d)
    out, lse = forward(q, k, v, tiles=tiles, **kw)
    judge(out, lse, q, k, v, q64, k64, v64, "float16", **kw)
    assert tc_configs and all(cfg.fragments == 2 for cfg in tc_configs)


def test_two_fragments_attn_bias_in_bfloat16(rng, tc_configs):
    (q, k, v), (q64, k64, v64) = inputs(rng, "bfloat16", 1, 39, 47, 2, 1, 16)
    bias = rng.standard_normal((1, 2, 39, 47)).astype(np.float32)
    bias[rng.random(bias.shape) < 0.2] = -np.inf
    bias[0, 1, 21] = -np.inf                      # a row of the second fragment that sees nothing
    kw = dict(attn_bias=torch.from_numpy(bias), causal=True)
    out, lse = forward(q, k, v, tiles=F2_TWO_WARPS, **kw)
    assert torch.all(out[0, 21, 1] == 0) and lse[0, 1, 21] == np.inf
    judge(out, lse, q, k, v, q64, k64, v64, "bfloat16", attn_bias=bias, causal=True)
    assert [cfg.fragments for cfg in tc_configs] == [2]


def test_two_fragments_with_q_in_shared_memory_and_dv_unlike_d(rng, tc_configs):
    # D = 80, Dv = 48: bucket 128, where two fragments' Q would not fit registers, so Q stays in shared memory.
    (q, k, _), (q64, k64, _) = inputs(rng, "float16", 1, 37, 43, 1, 1, 80)
    v = torch.from_numpy(rng.standard_normal((1, 43, 1, 48)).astype(np.float32)).half()
    out, lse = forward(q, k, v, tiles=F2_ONE_WARP, causal=True)
    ref, ref_lse = attention_ref(q64, k64, v.double().numpy(), causal=True)
    assert out.shape == (1, 37, 1, 48)
    err = rel_l2(out.double().numpy(), ref)
    assert err <= BOUND["float16"] and err <= 2 * rel_l2(naive_same_dtype(q, k, v, causal=True), ref)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=0, atol=1e-4)
    assert [(cfg.fragments, cfg.q_in_registers) for cfg in tc_configs] == [(2, False)]


def test_two_fragments_with_mods(rng, tc_configs):
    # mask_mod and bias_mod are staged per fragment in shared memory (the second fragment's slots past the first's).
    (q, k, v), (q64, k64, v64) = inputs(rng, "float16", 1, 37, 41, 2, 1, 16)
    kw = dict(mask_mod=doc_mask, bias_mod=head_bias, score_mod=soft_clip, causal=True)
    out, lse = forward(q, k, v, tiles=F2_ONE_WARP, **kw)
    judge(out, lse, q, k, v, q64, k64, v64, "float16", **kw)
    assert [cfg.fragments for cfg in tc_configs] == [2]


def test_two_fragments_on_packed_sequences(rng, tc_configs):
    lens_q, lens_k = [5, 0, 38, 19], [7, 3, 45, 19]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    (q, k, v), (q64, k64, v64) = inputs(rng, "float16", 1, int(cu_q[-1]), int(cu_k[-1]), 2, 1, 16)
    q, k, v, q64, k64, v64 = (x[0] for x in (q, k, v, q64, k64, v64))   # (total, H, D)
    out, lse = forward(q, k, v, tiles=F2_TWO_WARPS, causal=True, cu_seqlens_q=torch.from_numpy(cu_q),
                       cu_seqlens_k=torch.from_numpy(cu_k), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    lse = np.asarray(lse)
    for i in range(len(lens_q)):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if lens_q[i] == 0:
            continue
        ref, ref_lse = attention_ref(q64[None, rows], k64[None, keys], v64[None, keys], causal=True)
        naive = naive_same_dtype(q[None, rows], k[None, keys], v[None, keys], causal=True)
        err = rel_l2(out[None, rows].double().numpy(), ref)
        assert err <= BOUND["float16"] and err <= 2 * max(rel_l2(naive, ref), 1e-4), (i, err)
        np.testing.assert_allclose(lse[:, rows], ref_lse[0], rtol=0, atol=1e-4)
    assert tc_configs and all(cfg.fragments == 2 for cfg in tc_configs)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_an_inf_in_v_poisons_only_its_column_of_the_rows_that_see_it(rng):
    # The rows that see a key whose V holds an inf get NaN in that column after the loop: in both fragments.
    (q, k, v), _ = inputs(rng, "float16", 1, 45, 51, 1, 1, 16)
    clean_out, clean_lse = forward(q, k, v, tiles=F2_TWO_WARPS, causal=True)
    v[0, 29, 0, 3] = float("inf")
    out, lse = forward(q, k, v, tiles=F2_TWO_WARPS, causal=True)
    poisoned = np.arange(45) + 6 >= 29           # causal, bottom right: row i sees key j iff j <= i + 6
    o, co = out[0, :, 0].float().numpy(), clean_out[0, :, 0].float().numpy()
    assert np.isnan(o[poisoned, 3]).all() and np.isfinite(np.delete(o, 3, axis=1)).all()
    np.testing.assert_array_equal(o[~poisoned], co[~poisoned])
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(clean_lse))


def test_a_two_fragment_config_is_only_the_forward_s():
    from numba_flash.cuda.host.config import FlashAttentionConfig

    assert FlashAttentionConfig("tc_forward", 64, 32, 64, 64).problems() == []
    assert FlashAttentionConfig("tc_forward", 128, 32, 128, 64).fragments == 2
    assert FlashAttentionConfig("tc_forward", 64, 32, 128, 64).fragments == 1
    assert "needs 128 threads" in " ".join(FlashAttentionConfig("tc_backward_dq", 64, 32, 64, 64).problems())
    assert "needs 256 or 128 threads" in " ".join(FlashAttentionConfig("tc_forward", 128, 32, 64, 64).problems())
    # Two fragments' Q fits registers up to bucket 64; at 128 it stays in shared memory (more words).
    assert FlashAttentionConfig("tc_forward", 64, 32, 64, 64).q_in_registers
    two, one = FlashAttentionConfig("tc_forward", 64, 32, 64, 128), FlashAttentionConfig("tc_forward", 64, 32, 128, 128)
    assert not two.q_in_registers and two.smem_bytes() == (64 + 2 * 32) * 128 * 2 > one.smem_bytes()
