"""attn_bias's gradient (``return_dbias``) from the CUDA kernels, under the Numba CUDA simulator with toy tiles:
against the float64 reference for a bias with every batch entry and for one shared by the batch, the heads or both
(one dQ launch per batch entry and per head, summed in order), for one broadcast over the rows, the keys or both
(per-key and per-row sums, then summed over the rest), with causal, window, softcap, ALiBi, dropout, GQA and -inf
entries; float16 on the SIMT kernels (the tensor-core ones compute no dbias); the same bits on every run; and dbias
in the bias's kind and dtype. What the kernels leave to others is refused in test_attn_bias_sim.py.

Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_dbias_sim.py
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_sim_cases import BACKWARD_TILES, random_inputs, rel_l2
from mods_cases import document_mods, soft_clip, soft_clip_grad
from selfcheck_cases import checked_runs, spoil

from backends import backend_registry
from numba_flash import attention_ref, attention_ref_backward
from numba_flash.cuda import tile_config_override

pytestmark = [pytest.mark.cudasim, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

B, SQ, SK, HQ, HKV, D = 2, 11, 19, 2, 1, 8


def _backward(q, k, v, dout, bias, tiles, **kw):
    """dq, dk, dv, dbias of the cuda backend, given the reference's out and lse."""
    out, lse = attention_ref(q, k, v, attn_bias=bias, **{n: x for n, x in kw.items() if n != "score_mod_grad"})
    with tile_config_override(**tiles):
        op = backend_registry.get("flash", backend="cuda")
        return op.backward(dout, q, k, v, out.astype(q.dtype), lse.astype(np.float32), attn_bias=bias,
                           return_dbias=True, **kw)


def _bias(rng, shape, dtype=np.float32):
    bias = (2 * rng.standard_normal(shape)).astype(dtype)
    bias[rng.random(shape) < 0.1] = -np.inf   # hidden pairs: no gradient
    return bias


# Both dQ code paths add dbias (tiles "split": the score sums in parts; "whole": in one): each meets a per-batch bias
# and one shared by the batch.
@pytest.mark.parametrize("tiles,shape,kw", [
    ("split", (B, HQ, SQ, SK), dict(causal=True, softcap=2.5)),
    ("whole", (B, HQ, SQ, SK), dict(causal=True, softcap=2.5)),
    ("whole", (1, HQ, SQ, SK), dict(window_size=(6, 2), alibi_slopes=np.array([0.3, 0.9], np.float32))),
    ("split", (HQ, SQ, SK), dict(dropout_p=0.3, dropout_seed=7, causal=True)),
    # Shared by the heads: one dQ launch per head (and per batch entry when the batch shares it too), in order.
    ("whole", (B, 1, SQ, SK), dict(causal=True, alibi_slopes=np.array([0.3, 0.9], np.float32))),
    ("split", (SQ, SK), dict(window_size=(6, 2), softcap=2.5)),
    # With dropout: each per-head launch keys dropout's mask by its real head (and batch entry).
    ("whole", (SQ, SK), dict(dropout_p=0.3, dropout_seed=9, softcap=2.5)),
], ids=["split-per-batch-causal-softcap", "whole-per-batch-causal-softcap", "whole-shared-window-alibi",
        "split-shared-3d-dropout", "whole-head-shared-causal-alibi-gqa", "split-batch-and-head-shared",
        "whole-batch-and-head-shared-dropout-softcap"])
def test_dbias_matches_the_reference(rng, shape, kw, tiles):
    q, k, v, dout = random_inputs(rng, B, SQ, SK, HQ, HKV, D)
    bias = _bias(rng, shape)
    before = bias.copy()
    dq, dk, dv, dbias = _backward(q, k, v, dout, bias, BACKWARD_TILES[tiles], **kw)
    np.testing.assert_array_equal(bias, before)
    want = attention_ref_backward(dout, q, k, v, attn_bias=bias, return_dbias=True, **kw)
    assert dbias.shape == bias.shape and dbias.dtype == np.float32
    assert np.all(dbias[np.isneginf(bias)] == 0)
    for name, got, ref in zip(("dq", "dk", "dv", "dbias"), (dq, dk, dv, dbias), want):
        assert rel_l2(got, ref) <= 1e-5, name


# A bias broadcast over the query rows: each key's sum over the rows, from the dK/dV kernel (both its code paths),
# then over the batch and heads where the bias shares them; over the keys: each row's sum from the dQ kernel; over
# both: the rows' sums summed again. GQA (two query heads per kv head) in all.
@pytest.mark.parametrize("tiles,shape,kw", [
    ("split", (B, HQ, 1, SK), dict(causal=True, softcap=2.5)),
    ("split", (1, SK), dict(dropout_p=0.3, dropout_seed=7, causal=True)),
    ("whole", (B, 1, 1, SK), dict(causal=True, softcap=2.5, dropout_p=0.2, dropout_seed=3)),
    ("split", (B, HQ, SQ, 1), dict(causal=True, softcap=2.5)),
    ("whole", (HQ, SQ, 1), dict(window_size=(6, 2), dropout_p=0.3, dropout_seed=7)),
    ("split", (1,), dict(causal=True, alibi_slopes=np.array([0.3, 0.9], np.float32))),
    ("whole", (B, 1, 1, 1), dict(window_size=(3, 4), alibi_slopes=np.array([0.3, 0.9], np.float32))),
], ids=["split-keys-per-head-causal-softcap", "split-keys-shared-dropout",
        "whole-keys-head-shared-causal-softcap-dropout", "split-rows-per-head-causal-softcap",
        "whole-rows-batch-shared-window-dropout", "split-one-number-causal-alibi", "whole-per-batch-number-window-alibi"])
def test_dbias_of_a_bias_broadcast_over_rows_or_keys_matches_the_reference(rng, shape, kw, tiles):
    q, k, v, dout = random_inputs(rng, B, SQ, SK, HQ, HKV, D)
    bias = _bias(rng, shape)
    if bias.size == 1 or shape[-1] == 1:   # a hidden entry would hide whole rows (or everything)
        bias[np.isneginf(bias)] = 0.5
    before = bias.copy()
    dq, dk, dv, dbias = _backward(q, k, v, dout, bias, BACKWARD_TILES[tiles], **kw)
    np.testing.assert_array_equal(bias, before)
    want = attention_ref_backward(dout, q, k, v, attn_bias=bias, return_dbias=True, **kw)
    assert dbias.shape == bias.shape and dbias.dtype == np.float32
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert rel_l2(got, ref) <= 1e-5, name
    if shape[-1] == 1:
        # Softmax ignores a shift of a row, so a row's gradient is a sum of terms that cancel (zero but for
        # rounding): its error is measured against the size of the terms, the pairs' gradient of a full bias.
        pairs = attention_ref_backward(dout, q, k, v, attn_bias=np.broadcast_to(bias, (B, HQ, SQ, SK)).copy(),
                                       return_dbias=True, **kw)[3]
        assert np.linalg.norm(dbias - want[3]) <= 1e-5 * np.linalg.norm(pairs)
    else:
        assert np.all(dbias[np.isneginf(bias)] == 0)
        assert rel_l2(dbias, want[3]) <= 1e-5



# With user mods: attn_bias enters before score_mod, so its gradient takes score_mod_grad's factor and not softcap's.
# A full bias (dQ's pairs, both dQ paths) and one broadcast over the rows (dK/dV's per-key sums) and over the keys
# (dQ's per-row sums); mask_mod's first rows see nothing (their gradient is 0).
DOCS = np.repeat(np.arange(4), [5, 7, 1, 6])   # 19 key positions in 4 documents
doc_mask, head_bias = document_mods(DOCS, SQ, SK, blind_rows=2)


@pytest.mark.parametrize("tiles,shape,kw", [
    ("split", (B, HQ, SQ, SK), dict(bias_mod=head_bias, mask_mod=doc_mask, score_mod=soft_clip, softcap=2.5)),
    ("whole", (1, HQ, SQ, SK), dict(score_mod=soft_clip, causal=True, softcap=2.5, dropout_p=0.2, dropout_seed=5)),
    ("whole", (1, SK), dict(score_mod=soft_clip, mask_mod=doc_mask, softcap=2.5)),
    ("split", (HQ, SQ, 1), dict(score_mod=soft_clip, bias_mod=head_bias, causal=True)),
    # Shared by batch and heads: one dQ launch per (b, h), whose mods must see the call's b and h (bias_mod does).
    ("whole", (SQ, SK), dict(score_mod=soft_clip, bias_mod=head_bias, mask_mod=doc_mask, dropout_p=0.2,
                             dropout_seed=3)),
], ids=["split-pairs-all-mods-softcap", "whole-pairs-score-mod-causal-dropout", "whole-keys-score-and-mask-mod",
        "split-rows-score-and-bias-mod", "whole-batch-and-head-shared-all-mods-dropout"])
def test_dbias_with_user_mods_matches_the_reference(rng, shape, kw, tiles):
    q, k, v, dout = random_inputs(rng, B, SQ, SK, HQ, HKV, D)
    bias = _bias(rng, shape)
    if shape[-1] == 1:   # a hidden entry would hide a whole row
        bias[np.isneginf(bias)] = 0.5
    kw = dict(kw, score_mod_grad=soft_clip_grad)
    dq, dk, dv, dbias = _backward(q, k, v, dout, bias, BACKWARD_TILES[tiles], **kw)
    want = attention_ref_backward(dout, q, k, v, attn_bias=bias, return_dbias=True, **kw)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert rel_l2(got, ref) <= 1e-5, name
    if shape[-1] == 1:   # terms that cancel: judged against the pairs' gradient (as above)
        pairs = attention_ref_backward(dout, q, k, v, attn_bias=np.broadcast_to(bias, (B, HQ, SQ, SK)).copy(),
                                       return_dbias=True, **kw)[3]
        assert np.linalg.norm(dbias - want[3]) <= 1e-5 * np.linalg.norm(pairs)
    else:
        assert rel_l2(dbias, want[3]) <= 1e-5
    # the test can tell: without score_mod_grad's factor (a bias added after score_mod) dbias is another
    assert rel_l2(attention_ref_backward(dout, q, k, v, attn_bias=bias, return_dbias=True,
                                         **dict(kw, score_mod_grad=_one))[3], want[3]) > 1e-2

def test_a_broadcast_bias_gradient_has_the_same_bits_every_run_and_reaches_nan(rng):
    """The sums run in a fixed order; a NaN in dO poisons the sums of the rows (keys) it reaches, as the reference's
    gradient is NaN there, and no other. Two batch entries of two heads sharing a kv head (the sums do not depend
    on more; the simulator's time does)."""
    b, hq = 2, 2
    q, k, v, dout = random_inputs(rng, b, SQ, SK, hq, 1, D)
    bias = _bias(rng, (b, hq, 1, SK))
    bias[np.isneginf(bias)] = 0.5
    runs = [_backward(q, k, v, dout, bias, BACKWARD_TILES["split"], causal=True)[3] for _ in range(2)]
    np.testing.assert_array_equal(runs[0], runs[1])
    poisoned = dout.copy()
    poisoned[1, 4, 1, 3] = np.nan
    for shape in [(b, hq, 1, SK), (b, hq, SQ, 1)]:   # the per-key sums, then the per-row ones
        bias = _bias(rng, shape)
        bias[np.isneginf(bias)] = 0.5
        got = _backward(q, k, v, poisoned, bias, BACKWARD_TILES["whole"], causal=True)[3]
        want = attention_ref_backward(poisoned, q, k, v, attn_bias=bias, return_dbias=True, causal=True)[3]
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        assert np.isnan(got).any() and not np.isnan(got).all()


def test_float16_runs_on_the_simt_kernels_and_returns_the_bias_dtype(rng):
    q, k, v, dout = random_inputs(rng, 2, SQ, SK, HQ, HKV, 16, np.float16)
    bias = _bias(rng, (1, HQ, SQ, SK), np.float16)
    tiles = dict(block_m=16, block_n=16, threads=32)   # tensor-core-sized tiles: dbias still takes the SIMT kernels
    *grads, dbias = _backward(q, k, v, dout, bias, tiles, causal=True)
    assert dbias.dtype == np.float16 and dbias.shape == bias.shape
    want = attention_ref_backward(dout, q, k, v, attn_bias=bias, return_dbias=True, causal=True)
    for name, got, ref in zip(("dq", "dk", "dv", "dbias"), (*grads, dbias), want):
        assert rel_l2(got, ref) <= 2e-3, name
    explain = backend_registry.get("flash").explain(q, k, v, attn_bias=bias, backend="cuda")
    assert "tensor-core" in explain   # the forward: tensor cores; only the dbias backward leaves them


def test_the_same_bits_every_run_and_torch_in_torch_out(rng):
    """The same call twice, once with numpy arrays and once with torch tensors: the same bits, in the input's kind."""
    torch = pytest.importorskip("torch")
    q, k, v, dout = random_inputs(rng, B, SQ, SK, HQ, HKV, D)
    bias = _bias(rng, (1, HQ, SQ, SK))
    first = _backward(q, k, v, dout, bias, BACKWARD_TILES["split"], causal=True)[3]
    tbias = torch.from_numpy(bias)
    out, lse = attention_ref(q, k, v, attn_bias=bias, causal=True)
    with tile_config_override(**BACKWARD_TILES["split"]):
        got = backend_registry.get("flash", backend="cuda").backward(
            *(torch.from_numpy(np.asarray(x, np.float32)) for x in (dout, q, k, v, out, lse)), attn_bias=tbias,
            return_dbias=True, causal=True)[3]
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and tuple(got.shape) == bias.shape
    np.testing.assert_array_equal(got.numpy(), first)
    want = attention_ref_backward(dout, q, k, v, attn_bias=bias, return_dbias=True, causal=True)[3]
    assert rel_l2(first, want) <= 1e-5


@pytest.fixture
def runs(monkeypatch):
    """The self-check on, one toy fallback (8x8/32); the specialisations it checks."""
    yield from checked_runs(monkeypatch, (8, 8, 32))


def test_the_self_check_judges_dbias_and_a_wrong_one_falls_back(rng, monkeypatch, runs):
    """The dQ specialisation that sums dbias is checked on its own (dbias against the reference's); one whose
    dbias is off by 0.1% fails it, and the call runs on the fallback config."""
    from numba_flash.cuda import selfcheck

    # dbias is the last argument but four (the call's batch entry and head of the launch's first, then the row
    # statistics and their switch, follow)
    spoil(monkeypatch, "make_dq_kernel", -5, lambda cfg, kw: kw.get("dbias") and cfg.threads == 16)
    q, k, v, dout = random_inputs(rng, 2, SQ, SK, HQ, HKV, D)
    bias = _bias(rng, (2, HQ, SQ, SK))
    *_, dbias = _backward(q, k, v, dout, bias, BACKWARD_TILES["split"], causal=True)
    want = attention_ref_backward(dout, q, k, v, attn_bias=bias, return_dbias=True, causal=True)[3]
    assert rel_l2(dbias, want) <= 1e-5
    verdicts = {(s.cfg.kernel, s.cfg.threads, s.dbias): v.passed for (_, s), v in selfcheck.verdicts().items()}
    assert verdicts[("backward_dq", 16, "pairs")] is False and verdicts[("backward_dq", 32, "pairs")] is True
    failed = [v.reason for v in selfcheck.verdicts().values() if not v.passed]
    assert len(failed) == 1 and "dbias: relative L2 error" in failed[0] and "attn_bias dbias pairs" in failed[0]


@pytest.mark.parametrize("kernel,shape,mode,dbias_arg", [("make_dkdv_kernel", (1, SK), "per_key", -3),
                                                         ("make_dq_kernel", (SQ, 1), "per_row", -5)])
def test_the_self_check_judges_the_broadcast_sums_and_a_wrong_one_falls_back(rng, monkeypatch, runs, kernel, shape,
                                                                                mode, dbias_arg):
    """The kernels that sum a broadcast bias's gradient are checked on their own (against the reference's pairs'
    gradient summed likewise); one whose sums are off by 0.001 fails it, and the call runs on the fallback."""
    from numba_flash.cuda import selfcheck

    spoil(monkeypatch, kernel, dbias_arg, lambda cfg, kw: kw.get("dbias") == mode and cfg.threads == 16, how="shift")
    q, k, v, dout = random_inputs(rng, 2, SQ, SK, HQ, HKV, D)
    bias = _bias(rng, shape)
    bias[np.isneginf(bias)] = 0.5
    *_, dbias = _backward(q, k, v, dout, bias, BACKWARD_TILES["split"], causal=True)
    want = attention_ref_backward(dout, q, k, v, attn_bias=bias, return_dbias=True, causal=True)[3]
    assert np.abs(dbias - want).max() <= 1e-4
    name = kernel.removeprefix("make_").removesuffix("_kernel")
    verdicts = {(s.cfg.kernel, s.cfg.threads, s.dbias): v.passed for (_, s), v in selfcheck.verdicts().items()}
    assert verdicts[(f"backward_{name}", 16, mode)] is False and verdicts[(f"backward_{name}", 32, mode)] is True
    failed = [v.reason for v in selfcheck.verdicts().values() if not v.passed]
    assert len(failed) == 1 and "dbias: relative L2 error" in failed[0] and f"dbias {mode}" in failed[0]


def _one(score, b, h, q_idx, kv_idx):
    return 1.0
