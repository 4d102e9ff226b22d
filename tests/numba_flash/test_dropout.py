"""Dropout: the Philox generator against Random123's published answers, its numba, numpy and torch forms against
each other, the keep rate, the reference's dropout against a hand-built one, and dropout through the backends and
``flash_attn_func``."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

import numba_flash
from numba_flash import AttentionInputError, attention_ref, attention_ref_backward
from numba_flash import dropout as dr

# Random123's tests/kat_vectors, the three "philox4x32 10" lines: counter (4 words), key (2 words), expected.
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_known_answers_numpy_and_numba(ctr, key, want):
    words = [np.uint64(x) for x in ctr + key]
    assert [int(x) for x in dr.philox4x32_10(*words)] == list(want)
    assert [int(x) for x in dr.philox4x32_10_jit(*words)] == list(want)


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_known_answers_torch(ctr, key, want):
    torch = pytest.importorskip("torch")
    out = dr.philox4x32_10_torch(*(torch.tensor([x], dtype=torch.int64) for x in ctr), *key)
    assert [int(x) for x in out] == list(want)


@njit
def _words_numba(seed_lo, seed_hi, b, h, i, j):
    """The way a CPU kernel calls it: one (b, h, i, j) at a time, inside a loop."""
    out = np.empty(b.size, np.uint64)
    for n in range(b.size):
        out[n] = dropout_word_(seed_lo, seed_hi, b[n], h[n], i[n], j[n])
    return out


dropout_word_ = dr.dropout_word


def _random_keys(rng, n=2000):
    seed = int(rng.integers(0, 1 << 63)) * 2 + int(rng.integers(0, 2))   # the whole [0, 2**64), top bit too
    idx = [rng.integers(0, 4, n), rng.integers(0, 64, n), rng.integers(0, 1 << 20, n), rng.integers(0, 1 << 31, n)]
    return seed, [x.astype(np.int64) for x in idx]


@pytest.mark.parametrize("trial", range(3))
def test_numba_numpy_and_torch_words_agree_bit_for_bit(trial):
    rng = np.random.default_rng(100 + trial)
    seed, (b, h, i, j) = _random_keys(rng)
    lo, hi = dr.split_seed(seed)
    via_numba = _words_numba(lo, hi, b, h, i, j)
    u = [np.uint64(x) for x in (lo, hi)]
    words = dr.philox4x32_10(*(x.astype(np.uint64) for x in (j >> 2, i, h, b)), *u)
    via_numpy = np.choose(j & 3, words)
    np.testing.assert_array_equal(via_numba, via_numpy)
    torch = pytest.importorskip("torch")
    via_torch = dr.dropout_words_torch(seed, *(torch.from_numpy(x) for x in (b, h, i, j)))
    np.testing.assert_array_equal(via_torch.numpy().astype(np.uint64), via_numpy)
    # and the mask's own grid is the same function: spot-check a few of its cells
    grid = dr.dropout_words(seed, 3, 2, 5, 9)
    for cell in [(0, 0, 0, 0), (2, 1, 4, 8), (1, 0, 3, 5)]:
        assert grid[cell] == dr.dropout_word(lo, hi, *cell)


def test_keep_decision_matches_the_threshold_rule():
    rng = np.random.default_rng(5)
    seed, (b, h, i, j) = _random_keys(rng, 500)
    for p in (0.0, 0.1, 0.5, 0.97):
        threshold = dr.dropout_threshold(p)
        assert threshold == int(np.floor((1 - p) * 2.0 ** 32))
        words = _words_numba(*dr.split_seed(seed), b, h, i, j)
        keep = np.array([dr.dropout_keep(*dr.split_seed(seed), threshold, *x) for x in zip(b, h, i, j)])
        np.testing.assert_array_equal(keep, words < threshold)
    assert dr.dropout_mask(seed, 2, 3, 7, 11, 0.0).all()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_is_one_minus_p(p):
    rng = np.random.default_rng(int(p * 100))
    seed = int(rng.integers(0, 1 << 62))
    mask = numba_flash.dropout_mask(seed, 2, 3, 64, 96, p)
    n = mask.size
    # 5 standard deviations of a binomial mean: a biased generator (or a wrong threshold) fails this
    assert abs(mask.mean() - (1 - p)) <= 5 * np.sqrt(p * (1 - p) / n)
    # each (batch, head) keeps about as many: neither index is ignored by the mapping
    per_head = mask.mean(axis=(2, 3))
    assert np.abs(per_head - (1 - p)).max() <= 5 * np.sqrt(p * (1 - p) / (64 * 96))


def test_mask_sizes_are_checked():
    with pytest.raises(AttentionInputError, match=r"^seqlen_k: expected an int >= 0, got 2.0"):
        numba_flash.dropout_mask(1, 1, 1, 2, 2.0, 0.5)
    assert numba_flash.dropout_mask(1, 2, 1, 0, 3, 0.5).shape == (2, 1, 0, 3)


def test_mask_depends_on_every_index_and_the_seed():
    a = numba_flash.dropout_mask(1, 2, 2, 8, 12, 0.5)
    assert not np.array_equal(a, numba_flash.dropout_mask(2, 2, 2, 8, 12, 0.5))
    assert not np.array_equal(a, numba_flash.dropout_mask(1 + (1 << 32), 2, 2, 8, 12, 0.5))   # high seed word
    assert not np.array_equal(a[0], a[1]) and not np.array_equal(a[:, 0], a[:, 1])
    assert not np.array_equal(a[:, :, 0], a[:, :, 1]) and not np.array_equal(a[..., :4], a[..., 4:8])
    # a bigger grid holds the smaller one: the mask of (b, h, i, j) does not depend on the sizes
    np.testing.assert_array_equal(numba_flash.dropout_mask(1, 3, 3, 10, 20, 0.5)[:2, :2, :8, :12], a)


@pytest.mark.parametrize("p,match", [
    (float("nan"), "dropout_p: expected a real number in \\[0, 1\\), got nan"),
    (float("inf"), "dropout_p: expected .* got inf"),
    (True, "dropout_p: expected .* got True"),
    ("0.1", "dropout_p: expected .* got '0.1'"),
    (1.0, "dropout_p: expected .* got 1.0"),
    (-0.1, "dropout_p: expected .* got -0.1"),
])
def test_bad_dropout_p(p, match):
    with pytest.raises(AttentionInputError, match=match):
        numba_flash.dropout_mask(1, 1, 1, 2, 2, p)


@pytest.mark.parametrize("seed,match", [
    (-1, "got -1"), (1 << 64, "got 18446744073709551616"), (1.0, "got 1.0"), (True, "got True"),
    (None, r"dropout_p > 0 needs one.*got None"),
])
def test_bad_dropout_seed(seed, match):
    with pytest.raises(AttentionInputError, match=r"^dropout_seed: expected an int in \[0, 2\*\*64\).*" + match):
        numba_flash.dropout_mask(seed, 1, 1, 2, 2, 0.5)


# ---- the reference ----

def _inputs(rng, b=2, sq=37, sk=29, hq=3, hkv=1, d=24):
    q = rng.standard_normal((b, sq, hq, d))
    k = rng.standard_normal((b, sk, hkv, d))
    v = rng.standard_normal((b, sk, hkv, d))
    return q, k, v, rng.standard_normal(q.shape)


def _by_hand(q, k, v, p, seed, causal):
    """softmax(q k^T / sqrt(D)) with the bottom-right causal mask, dropped and scaled, times v, head by head."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    keep = numba_flash.dropout_mask(seed, b, hq, sq, sk, p)
    out = np.zeros_like(q)
    for bi in range(b):
        for h in range(hq):
            s = q[bi, :, h] @ k[bi, :, h // (hq // hkv)].T / np.sqrt(d)
            if causal:
                s[np.arange(sk)[None, :] > np.arange(sq)[:, None] + sk - sq] = -np.inf
            e = np.exp(s - s.max(axis=1, keepdims=True))
            probs = e / e.sum(axis=1, keepdims=True)
            out[bi, :, h] = (probs * keep[bi, h] / (1 - p)) @ v[bi, :, h // (hq // hkv)]
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_reference_forward_is_dropped_softmax_times_v(causal):
    rng = np.random.default_rng(7 + causal)
    q, k, v, _ = _inputs(rng, sq=29, sk=37) if causal else _inputs(rng)   # causal: every row sees a key
    p, seed = 0.3, int(rng.integers(0, 1 << 62))
    out, lse = attention_ref(q, k, v, causal=causal, dropout_p=p, dropout_seed=seed)
    np.testing.assert_allclose(out, _by_hand(q, k, v, p, seed, causal), rtol=1e-12, atol=1e-12)
    # lse is the undropped softmax's
    np.testing.assert_array_equal(lse, attention_ref(q, k, v, causal=causal)[1])
    assert np.abs(out - attention_ref(q, k, v, causal=causal)[0]).max() > 1e-2


@pytest.mark.parametrize("causal", [False, True])
def test_reference_backward_matches_autograd(causal):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(17 + causal)
    q, k, v, dout = _inputs(rng, sq=29, sk=37, hkv=3)
    p, seed = 0.25, int(rng.integers(0, 1 << 62))
    keep = torch.from_numpy(numba_flash.dropout_mask(seed, 2, 3, 29, 37, p))
    tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).requires_grad_() for x in (q, k, v))
    s = tq @ tk.transpose(-1, -2) / np.sqrt(24)
    if causal:
        s = s.masked_fill(torch.arange(37)[None, :] > torch.arange(29)[:, None] + 8, float("-inf"))
    out = (torch.softmax(s, dim=-1) * keep / (1 - p)) @ tv
    out.backward(torch.from_numpy(dout).transpose(1, 2))
    got = attention_ref_backward(dout, q, k, v, causal=causal, dropout_p=p, dropout_seed=seed)
    for g, t in zip(got, (tq, tk, tv)):
        np.testing.assert_allclose(g, t.grad.transpose(1, 2).numpy(), rtol=1e-10, atol=1e-12)


def test_reference_p_zero_is_no_dropout():
    rng = np.random.default_rng(27)
    q, k, v, dout = _inputs(rng)
    for a, b in zip(attention_ref(q, k, v, dropout_p=0.0, dropout_seed=5), attention_ref(q, k, v)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(attention_ref_backward(dout, q, k, v, dropout_p=0.0), attention_ref_backward(dout, q, k, v)):
        np.testing.assert_array_equal(a, b)


# ---- the backends that run it, and flash_attn_func ----
# The torch path ("rocm") picks itself only on HIP GPUs, so it is forced here; the CPU kernels are chosen.

CASES = [dict(), dict(causal=True), dict(window_size=(6, 3), softcap=2.5), dict(causal=True, softmax_scale=0.3)]


def _float32(rng, **sizes):
    return tuple(x.astype(np.float32) for x in _inputs(rng, **sizes))


@pytest.fixture(params=["rocm-one-block", "rocm-many-blocks", "cpu"])
def dropout_backend(request, monkeypatch):
    """The torch path with the whole problem in one block or cut into blocks of 8 x 8 (each makes its own mask),
    or the CPU kernels."""
    if request.param == "rocm-many-blocks":
        from numba_flash.torch_path import blocks

        monkeypatch.setattr(blocks, "CPU_BLOCK_Q", 8)
        monkeypatch.setattr(blocks, "CPU_BLOCK_K", 8)
    return request.param.split("-")[0]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_backend_forward_backward_match_reference(case, dropout_backend):
    torch = pytest.importorskip("torch")
    from numba_flash import backend_registry

    rng = np.random.default_rng(40 + case)
    q, k, v, dout = _float32(rng, hkv=1 if case % 2 else 3)
    p, seed = (0.2, 0.5, 0.1, 0.7)[case], int(rng.integers(0, 1 << 64, dtype=np.uint64))
    kw = dict(CASES[case], dropout_p=p, dropout_seed=seed)
    t = {n: torch.from_numpy(x) for n, x in dict(q=q, k=k, v=v, dout=dout).items()}
    op = backend_registry.get("flash", backend=dropout_backend)
    out, lse = op.forward(t["q"], t["k"], t["v"], return_lse=True, **kw)
    grads = op.backward(t["dout"], t["q"], t["k"], t["v"], out, lse, **kw)
    want_out, want_lse = attention_ref(q, k, v, **kw)
    np.testing.assert_allclose(out.numpy(), want_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=2e-5, rtol=1e-5)
    for got, want in zip(grads, attention_ref_backward(dout, q, k, v, **kw)):
        assert np.linalg.norm(got.numpy() - want) <= 1e-5 * np.linalg.norm(want)


# Sizes that cross the CPU kernels' 64 x 64 tiles, with a last key tile of 133 - 128 = 5 keys (one whole group of
# four keys per Philox call and one key alone).
CPU_CASES = [dict(), dict(causal=True), dict(window_size=(40, 9), softcap=3.0),
             dict(alibi_slopes=np.array([0.3, 0.05, 0.7]))]


@pytest.fixture(params=[False, True], ids=["dq-pass", "dq-fused"])
def fuse_dq(request, monkeypatch):
    """The CPU backward's dQ in a pass of its own, or fused into the key-tile pass (which it does when there are
    at least two (batch, kv head) pairs per thread): the thread count it sees is set to force either."""
    import types

    from numba_flash.cpu import backward

    threads = 1 if request.param else 1 << 20
    monkeypatch.setattr(backward, "numba", types.SimpleNamespace(get_num_threads=lambda: threads))
    return request.param


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_cpu_kernels_across_tiles_match_reference(case, fuse_dq, dtype, tol):
    from numba_flash import backend_registry

    hkv = 1 + 2 * (case % 2)   # GQA (3 query heads per kv head) or not
    rng = np.random.default_rng(80 + case + 10 * fuse_dq)
    q, k, v, dout = (x.astype(dtype) for x in _inputs(rng, sq=150, sk=133, hkv=hkv))
    if case == 1:
        q, k, v, dout = (x.astype(dtype) for x in _inputs(rng, sq=133, sk=150, hkv=hkv))  # every row sees a key
    kw = dict(CPU_CASES[case], dropout_p=(0.15, 0.5, 0.3, 0.05)[case],
              dropout_seed=int(rng.integers(0, 1 << 64, dtype=np.uint64)))
    op = backend_registry.get("flash", backend="cpu")
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    want_out, want_lse = attention_ref(q, k, v, **kw)
    np.testing.assert_allclose(out, want_out, atol=tol, rtol=0)
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[seen], want_lse[seen], atol=tol, rtol=tol)
    wants = attention_ref_backward(dout, q, k, v, **kw)
    for got, want in zip(op.backward(dout, q, k, v, out, lse, **kw), wants):
        assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)
    # the lse of another forward (no stash to reuse) takes the backward's own statistics pass: same gradients
    for got, want in zip(op.backward(dout, q, k, v, out, lse.copy(), **kw), wants):
        assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)


def test_cpu_kernels_drop_what_the_mask_says():
    """Dropout 0.5 with V the identity: out row i is P_i * keep_i / 0.5 itself, so every dropped pair reads 0 and
    every kept one 2 P. Checks the (b, h, i, j) -> mask mapping directly, with a batch and heads."""
    from numba_flash import backend_registry

    rng = np.random.default_rng(90)
    b, sq, sk, h = 2, 70, 67, 2
    q = rng.standard_normal((b, sq, h, sk))   # D = Sk, as V is the identity (Sk, Sk)
    k = rng.standard_normal((b, sk, h, sk))
    v = np.broadcast_to(np.eye(sk)[None, :, None, :], (b, sk, h, sk)).copy()
    seed = int(rng.integers(0, 1 << 62))
    out = backend_registry.get("flash", backend="cpu").forward(q, k, v, dropout_p=0.5, dropout_seed=seed)
    probs = attention_ref(q, k, v)[0].transpose(0, 2, 1, 3)   # (B, H, Sq, Sk): P itself
    keep = numba_flash.dropout_mask(seed, b, h, sq, sk, 0.5)
    got = out.transpose(0, 2, 1, 3)
    assert np.all(got[~keep] == 0)
    np.testing.assert_allclose(got[keep], 2 * probs[keep], rtol=1e-12, atol=1e-15)
    assert 0.4 < keep.mean() < 0.6


def test_registry_says_which_backends_run_dropout():
    torch = pytest.importorskip("torch")
    from numba_flash import backend_registry

    rng = np.random.default_rng(50)
    q, k, v, _ = _float32(rng)
    from backends.base import Backend
    from numba_flash.validation import validate_forward

    call = validate_forward(q, k, v, dropout_p=0.1, dropout_seed=1)
    for be in backend_registry.backends("flash"):   # cuda's kernels: tests/numba_flash/cuda/test_dropout_sim.py
        assert "dropout not supported" not in be.feature_reasons(call), be.name
    assert "dropout not supported" in Backend.feature_reasons(Backend(), call)
    text = backend_registry.get("flash").explain(*(torch.from_numpy(x) for x in (q, k, v)), dropout_p=0.1,
                                                 dropout_seed=1)
    assert " dropout=0.1 " in text and "cpu [priority 10]: can serve" in text
    with pytest.raises(AttentionInputError, match="^dropout_seed: expected an int in .*needs one"):
        backend_registry.get("flash").forward(q, k, v, dropout_p=0.1)


FUNC_BACKENDS = ["rocm", "cpu"]


def _flash(torch, arrays, backend, **kw):
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in arrays[:3])
    out = numba_flash.flash_attn_func(tq, tk, tv, backend=backend, **kw)
    out.backward(torch.from_numpy(arrays[3]))
    return out.detach(), tq.grad, tk.grad, tv.grad


@pytest.mark.parametrize("backend", FUNC_BACKENDS)
def test_flash_attn_func_dropout_matches_reference_through_autograd(backend):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(60)
    arrays = _float32(rng)
    q, k, v, dout = arrays
    seed = int(rng.integers(0, 1 << 62))
    got = _flash(torch, arrays, backend, dropout_p=0.3, causal=True, dropout_seed=seed)
    kw = dict(causal=True, dropout_p=0.3, dropout_seed=seed)
    np.testing.assert_allclose(got[0].numpy(), attention_ref(q, k, v, **kw)[0], atol=2e-5, rtol=0)
    for g, want in zip(got[1:], attention_ref_backward(dout, q, k, v, **kw)):
        assert np.linalg.norm(g.numpy() - want) <= 1e-5 * np.linalg.norm(want)
    # positionally, as flash-attn's signature puts dropout_p third
    again = numba_flash.flash_attn_func(*(torch.from_numpy(x) for x in arrays[:3]), 0.3, None, True,
                                        dropout_seed=seed, backend=backend)
    assert torch.equal(again, got[0])


@pytest.mark.parametrize("backend", FUNC_BACKENDS)
def test_flash_attn_func_seeds(backend):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(61)
    arrays = _float32(rng)
    a = _flash(torch, arrays, backend, dropout_p=0.4, dropout_seed=11, deterministic=True)
    b = _flash(torch, arrays, backend, dropout_p=0.4, dropout_seed=11, deterministic=True)
    for x, y in zip(a, b):   # same seed: same output, and the backward bit for bit the same
        assert torch.equal(x, y)
    c = _flash(torch, arrays, backend, dropout_p=0.4, dropout_seed=12)
    assert not torch.equal(a[0], c[0])
    # p = 0 is no dropout at all, whatever the seed
    plain = _flash(torch, arrays, backend)
    for x, y in zip(plain, _flash(torch, arrays, backend, dropout_p=0.0, dropout_seed=12)):
        assert torch.equal(x, y)
    # no seed: one is drawn from torch's default generator and kept for the backward
    torch.manual_seed(3)
    d = _flash(torch, arrays, backend, dropout_p=0.4)
    torch.manual_seed(3)
    e = _flash(torch, arrays, backend, dropout_p=0.4)
    f = _flash(torch, arrays, backend, dropout_p=0.4)
    for x, y in zip(d, e):
        assert torch.equal(x, y)
    assert not torch.equal(d[0], f[0])
    torch.manual_seed(3)
    seed = int(torch.randint(-(1 << 63), (1 << 63) - 1, ())) % (1 << 64)
    q, k, v, dout = arrays
    np.testing.assert_allclose(d[0].numpy(), attention_ref(q, k, v, dropout_p=0.4, dropout_seed=seed)[0],
                               atol=2e-5, rtol=0)
    for g, want in zip(d[1:], attention_ref_backward(dout, q, k, v, dropout_p=0.4, dropout_seed=seed)):
        assert np.linalg.norm(g.numpy() - want) <= 1e-5 * np.linalg.norm(want)


@pytest.mark.parametrize("seed", [-1, 1 << 64, 2.0, "7"])
def test_flash_attn_func_bad_seed(seed):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.zeros(1, 3, 2, 4) for _ in range(3))
    with pytest.raises(AttentionInputError, match=r"^dropout_seed: expected an int in \[0, 2\*\*64\)"):
        numba_flash.flash_attn_func(q, k, v, dropout_p=0.5, dropout_seed=seed)


@pytest.mark.parametrize("backend", FUNC_BACKENDS)
def test_flash_attn_varlen_func_dropout_keys_each_sequence_by_its_index(backend):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(70)
    lens_q, lens_k = [13, 0, 21, 9], [17, 5, 11, 24]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q = rng.standard_normal((cu_q[-1], 3, 16)).astype(np.float32)
    k, v = (rng.standard_normal((cu_k[-1], 1, 16)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    seed = 2 ** 63 + 12345   # a seed with the top bit set, through the ops' signed int64
    out = numba_flash.flash_attn_varlen_func(tq, tk, tv, torch.from_numpy(cu_q), torch.from_numpy(cu_k),
                                             max(lens_q), max(lens_k), 0.35, causal=True, dropout_seed=seed,
                                             backend=backend)
    out.backward(torch.from_numpy(dout))
    for b in range(4):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if not lens_q[b]:
            continue
        # sequence b alone, with the mask of batch index b: dense batch b + 1 whose first b entries are ignored
        pad = lambda x, sl: np.concatenate([np.zeros((b,) + x[sl].shape, np.float32), x[sl][None]])  # noqa: E731
        kw = dict(causal=True, dropout_p=0.35, dropout_seed=seed)
        want = attention_ref(pad(q, rows), pad(k, keys), pad(v, keys), **kw)[0][b]
        np.testing.assert_allclose(out[rows].detach().numpy(), want, atol=2e-5, rtol=0)
        grads = attention_ref_backward(pad(dout, rows), pad(q, rows), pad(k, keys), pad(v, keys), **kw)
        for g, sl, w in zip((tq.grad, tk.grad, tv.grad), (rows, keys, keys), grads):
            assert np.linalg.norm(g[sl].numpy() - w[b]) <= 1e-5 * np.linalg.norm(w[b]) + 1e-12


# ---- the CUDA device form: the same body, compiled with cuda.jit ----

def _word_kernel():
    """A kernel that writes every (b, h, i, j)'s word, calling the device form through a module global: the
    simulator swaps a kernel's global ``cuda`` for its own (a closure's it would not)."""
    global cuda, _device_word
    from numba import cuda

    _device_word = dr.compile_with(cuda.jit(device=True, inline=True))[1]
    return _words_kernel


def _words_kernel(out, seed_lo, seed_hi, nheads, seqlen_q, seqlen_k):
    n = cuda.grid(1)
    if n < out.size:
        j = n % seqlen_k
        i = (n // seqlen_k) % seqlen_q
        h = (n // (seqlen_k * seqlen_q)) % nheads
        b = n // (seqlen_k * seqlen_q * nheads)
        out[n] = _device_word(seed_lo, seed_hi, b, h, i, j)


@pytest.mark.ptx
def test_device_form_compiles_to_ptx():
    pytest.importorskip("numba.cuda")
    from numba import int64, uint64
    from numba.cuda.cudadrv import nvvm

    if not nvvm.is_available():
        pytest.skip("no NVVM (numba-cuda's compiler) here")

    kernel = _word_kernel()
    ptx, _ = cuda.compile_ptx(kernel, (uint64[:], uint64, uint64, int64, int64, int64), cc=(8, 0))
    assert "mul.wide.u32" in ptx or "mul.hi.u32" in ptx or "mul.lo.s64" in ptx


@pytest.mark.cudasim
def test_device_form_matches_numpy_in_the_simulator():
    from numba import cuda

    seed = (1 << 63) + 987654321
    want = dr.dropout_words(seed, 2, 3, 5, 7).ravel()
    out = cuda.to_device(np.zeros(want.size, np.uint64))
    cuda.jit(_word_kernel())[(want.size + 63) // 64, 64](out, *dr.split_seed(seed), 3, 5, 7)
    np.testing.assert_array_equal(out.copy_to_host(), want)
