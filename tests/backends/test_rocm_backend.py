"""The ROCm backend (plain torch: SDPA where it fits, blockwise online softmax elsewhere), run on CPU tensors.

No AMD GPU is needed: forced with backend="rocm" the same torch code runs on any device. Automatic selection on a
HIP device is checked by faking a HIP build of torch.
"""

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import backends.rocm as rocm  # noqa: E402
import numba_flash.torch_path.blocks as tp_blocks  # noqa: E402
import numba_flash.torch_path.scores as tp_scores  # noqa: E402
from backends import backend_registry  # noqa: E402
from numba_flash import AttentionInputError, attention_ref, attention_ref_backward, validate_forward  # noqa: E402
from numba_flash.semantics import effective_window, visible_mask  # noqa: E402

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64}


@pytest.fixture
def op(monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)
    return backend_registry.get("flash", backend="rocm")


@pytest.fixture(params=["default_blocks", "small_blocks"])
def blocks(request, monkeypatch):
    """Run each case with the real block sizes (one block at these sizes) and with tiny ones, which make many
    query and key blocks, partial blocks at the edges, and key blocks skipped outside the band."""
    if request.param == "small_blocks":
        monkeypatch.setattr(tp_blocks, "block_sizes", lambda call: (5, 7))
    return request.param


def _shape(b, s, h, d, layout):
    return (b, s, h, d) if layout == "bshd" else (b, h, s, d)


def _qkv(rng, b, sq, sk, hq, hkv, d, layout="bshd", dtype="float32"):
    t = TORCH_DTYPES[dtype]
    q = torch.from_numpy(rng.standard_normal(_shape(b, sq, hq, d, layout))).to(t)
    k = torch.from_numpy(rng.standard_normal(_shape(b, sk, hkv, d, layout))).to(t)
    v = torch.from_numpy(rng.standard_normal(_shape(b, sk, hkv, d, layout))).to(t)
    return q, k, v


def _np(x):
    return x.detach().to(torch.float64).numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float64)


def _rel_l2(got, want):
    return float(np.linalg.norm(_np(got) - want) / np.linalg.norm(want))


# (B, Sq, Sk, Hq, Hkv, D, causal, window, softcap, layout)
CASES = {
    "mha": (2, 37, 37, 3, 3, 16, False, (-1, -1), 0.0, "bshd"),
    "gqa_causal_sq_lt_sk": (2, 23, 41, 6, 2, 19, True, (-1, -1), 0.0, "bshd"),
    "mqa_causal_sq_gt_sk_bhsd": (1, 45, 29, 4, 1, 8, True, (-1, -1), 0.0, "bhsd"),
    "window": (1, 33, 47, 4, 2, 12, False, (6, 3), 0.0, "bshd"),
    "window_causal_bhsd": (2, 31, 31, 2, 1, 7, True, (4, -1), 0.0, "bhsd"),
    "softcap_gqa": (1, 29, 35, 6, 3, 24, True, (-1, -1), 3.0, "bshd"),
    "left_only_window_sq_gt_sk": (1, 40, 17, 2, 2, 5, False, (2, -1), 0.0, "bshd"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_float32_matches_reference(rng, op, blocks, case):
    b, sq, sk, hq, hkv, d, causal, window, softcap, layout = case
    q, k, v = _qkv(rng, b, sq, sk, hq, hkv, d, layout)
    kw = dict(causal=causal, window_size=window, softcap=softcap, layout=layout)
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = attention_ref(q, k, v, **kw)
    assert out.dtype == torch.float32 and out.shape == q.shape and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, sq)
    assert np.abs(_np(out) - ref_out).max() <= 1e-5
    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isinf(_np(lse)), ~seen)
    assert np.abs(_np(lse)[seen] - ref_lse[seen]).max() <= 1e-5

    dout = torch.from_numpy(rng.standard_normal(q.shape)).float()
    grads = op.backward(dout, q, k, v, out, lse, **kw)
    ref_grads = attention_ref_backward(dout, q, k, v, **kw)
    for name, g, x, want in zip("qkv", grads, (q, k, v), ref_grads):
        assert g.shape == x.shape and g.dtype == torch.float32, name
        assert _rel_l2(g, want) <= 1e-5, name


def test_float64(rng, op, blocks):
    q, k, v = _qkv(rng, 2, 19, 26, 4, 2, 11, dtype="float64")
    out, lse = op.forward(q, k, v, causal=True, softcap=2.0, return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, causal=True, softcap=2.0)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert np.abs(out.numpy() - ref_out).max() <= 1e-12
    assert np.abs(lse.numpy() - ref_lse).max() <= 1e-12
    dout = torch.from_numpy(rng.standard_normal(q.shape))
    for g, want in zip(op.backward(dout, q, k, v, out, lse, causal=True, softcap=2.0),
                       attention_ref_backward(dout, q, k, v, causal=True, softcap=2.0)):
        assert _rel_l2(g, want) <= 1e-12


def test_rows_that_see_no_key(rng, op, blocks):
    # Causal with Sq > Sk: rows i < Sq - Sk see no key at all.
    sq, sk = 21, 8
    q, k, v = _qkv(rng, 2, sq, sk, 4, 2, 9)
    out, lse = op.forward(q, k, v, causal=True, return_lse=True)
    empty = sq - sk
    assert torch.all(out[:, :empty] == 0)
    assert torch.all(torch.isposinf(lse[:, :, :empty]))
    assert torch.all(torch.isfinite(lse[:, :, empty:]))
    dout = torch.from_numpy(rng.standard_normal(q.shape)).float()
    dq, dk, dv = op.backward(dout, q, k, v, out, lse, causal=True)
    assert torch.all(dq[:, :empty] == 0)
    for t in (out, dq, dk, dv):
        assert not torch.isnan(t).any()
    for g, want in zip((dq, dk, dv), attention_ref_backward(dout, q, k, v, causal=True)):
        assert _rel_l2(g, want) <= 1e-5


def _naive(q, k, v, causal, window, layout):
    """Textbook attention in q's dtype (scores, softmax and product all in that dtype), GQA by repeating heads."""
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    left, right = effective_window(causal, window)
    mask = torch.from_numpy(visible_mask(q.shape[2], k.shape[2], left, right))
    out = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v
    return out.transpose(1, 2) if layout == "bshd" else out


@pytest.mark.parametrize("dtype,bound", [("float16", 2e-3), ("bfloat16", 1.6e-2)])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_half_precision(rng, op, dtype, bound, layout):
    kw = dict(causal=True, window_size=(-1, -1), layout=layout)
    q, k, v = _qkv(rng, 2, 45, 61, 4, 2, 32, layout, dtype)
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    assert out.dtype == TORCH_DTYPES[dtype] and lse.dtype == torch.float32
    ref_out, _ = attention_ref(q, k, v, **kw)
    err = _rel_l2(out, ref_out)
    naive_err = _rel_l2(_naive(q, k, v, kw["causal"], kw["window_size"], layout), ref_out)
    assert err <= bound and err <= 2 * naive_err, (err, naive_err)

    dout = torch.from_numpy(rng.standard_normal(q.shape)).to(q.dtype)
    grads = op.backward(dout, q, k, v, out, lse, **kw)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    _naive(*leaves, kw["causal"], kw["window_size"], layout).backward(dout)
    for name, g, leaf, want in zip("qkv", grads, leaves, attention_ref_backward(dout, q, k, v, **kw)):
        assert g.dtype == q.dtype, name
        err, naive_err = _rel_l2(g, want), _rel_l2(leaf.grad, want)
        assert err <= bound and err <= 2 * naive_err, (name, err, naive_err)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_numpy_in_numpy_out_when_forced(rng, op, dtype):
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((2, 17, 4, 8), (2, 25, 2, 8), (2, 25, 2, 8)))
    q.flags.writeable = False                      # read-only input: must not warn or fail
    k = np.ascontiguousarray(k[:, ::-1])[:, ::-1]  # negative strides: torch.from_numpy refuses these
    out, lse = op.forward(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, np.ndarray) and out.dtype == q.dtype and out.shape == q.shape
    assert isinstance(lse, np.ndarray) and lse.dtype == np.float32 and lse.shape == (2, 4, 17)
    ref_out, _ = attention_ref(q, k, v, causal=True)
    dout = rng.standard_normal(q.shape).astype(dtype)
    grads = op.backward(dout, q, k, v, out, lse, causal=True)
    assert all(isinstance(g, np.ndarray) and g.dtype == q.dtype for g in grads)
    ref_grads = attention_ref_backward(dout, q, k, v, causal=True)
    if dtype == "float32":
        assert np.abs(out - ref_out).max() <= 1e-5
        assert all(_rel_l2(g, w) <= 1e-5 for g, w in zip(grads, ref_grads))
    else:
        assert _rel_l2(out, ref_out) <= 2e-3
        assert all(_rel_l2(g, w) <= 2e-3 for g, w in zip(grads, ref_grads))


def test_non_contiguous_inputs(rng, op, blocks):
    # q: a bshd view of a bhsd tensor; k, v: every other head of a wider tensor, with the sequence sliced.
    q = torch.from_numpy(rng.standard_normal((2, 3, 27, 10))).float().transpose(1, 2)
    kv_wide = torch.from_numpy(rng.standard_normal((2, 40, 6, 10))).float()
    k, v = kv_wide[:, 5:36, 0::2], kv_wide[:, 3:34, 1::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out, lse = op.forward(q, k, v, causal=True, return_lse=True)
    ref_out, _ = attention_ref(q, k, v, causal=True)
    assert np.abs(_np(out) - ref_out).max() <= 1e-5
    dout = torch.from_numpy(rng.standard_normal((2, 27, 3, 10))).float()[:, :, [2, 0, 1]]
    for g, want in zip(op.backward(dout, q, k, v, out, lse, causal=True),
                       attention_ref_backward(dout, q, k, v, causal=True)):
        assert _rel_l2(g, want) <= 1e-5


@pytest.mark.parametrize("return_lse", [False, True], ids=["sdpa_path", "blockwise_path"])
def test_inputs_never_modified(rng, op, return_lse):
    q, k, v = _qkv(rng, 1, 13, 13, 4, 2, 6)
    dout = torch.from_numpy(rng.standard_normal(q.shape)).float()
    before = [x.clone() for x in (q, k, v, dout)]
    res = op.forward(q, k, v, causal=True, return_lse=return_lse)
    out, lse = res if return_lse else op.forward(q, k, v, causal=True, return_lse=True)
    out_before, lse_before = out.clone(), lse.clone()
    op.backward(dout, q, k, v, out, lse, causal=True)
    for x, x0 in zip((q, k, v, dout, out, lse), before + [out_before, lse_before]):
        assert torch.equal(x, x0)


def test_requires_grad_inputs_build_no_graph(rng, op):
    q, k, v = (x.requires_grad_() for x in _qkv(rng, 1, 9, 11, 2, 1, 4))
    out, lse = op.forward(q, k, v, return_lse=True)
    assert not out.requires_grad and not lse.requires_grad


@pytest.fixture
def sdpa_spy(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-6), ("float64", 1e-12)])
@pytest.mark.parametrize("sq,sk,hq,hkv,causal,layout", [
    (33, 47, 4, 4, False, "bshd"),
    (39, 39, 6, 2, True, "bshd"),      # GQA through enable_gqa, square causal
    (21, 30, 3, 1, False, "bhsd"),     # MQA
])
def test_sdpa_path_agrees_with_blockwise(rng, op, sdpa_spy, dtype, tol, sq, sk, hq, hkv, causal, layout):
    q, k, v = _qkv(rng, 2, sq, sk, hq, hkv, 16, layout, dtype)
    kw = dict(causal=causal, layout=layout, softmax_scale=0.3)
    fast = op.forward(q, k, v, **kw)
    assert len(sdpa_spy) == 1 and sdpa_spy[0]["scale"] == 0.3
    assert sdpa_spy[0].get("enable_gqa", False) == (hq != hkv)   # GQA by SDPA itself, K/V not repeated first
    blockwise, _ = op.forward(q, k, v, return_lse=True, **kw)  # asking for lse takes the blockwise path
    assert len(sdpa_spy) == 1
    assert fast.dtype == q.dtype and fast.shape == q.shape and fast.is_contiguous()
    assert torch.allclose(fast, blockwise, rtol=0, atol=tol)
    ref_out, _ = attention_ref(q, k, v, **kw)
    assert np.abs(_np(fast) - ref_out).max() <= max(tol, 1e-5 if dtype == "float32" else 1e-12)


@pytest.mark.parametrize("dtype,bound", [("float16", 2e-3), ("bfloat16", 1.6e-2)])
@pytest.mark.parametrize("hq,hkv,causal", [(4, 4, False), (6, 2, True)])
def test_sdpa_path_half_precision(rng, op, sdpa_spy, dtype, bound, hq, hkv, causal):
    """The SDPA path keeps the contract's low-precision bound: within ``bound`` of the float64 reference and at
    most twice the error of naive attention computed in the same dtype."""
    q, k, v = _qkv(rng, 2, 57, 57, hq, hkv, 32, "bhsd", dtype)
    out = op.forward(q, k, v, causal=causal, layout="bhsd")
    assert len(sdpa_spy) == 1 and out.dtype == q.dtype
    ref_out, _ = attention_ref(q, k, v, causal=causal, layout="bhsd")
    err = _rel_l2(out, ref_out)
    naive_err = _rel_l2(_naive(q, k, v, causal, (-1, -1), "bhsd"), ref_out)
    assert err <= bound and err <= 2 * naive_err, (err, naive_err)


@pytest.mark.parametrize("sq,sk,kw", [
    (20, 31, dict(causal=True)),                  # SDPA's is_causal is top-left aligned: wrong when Sq != Sk
    (31, 20, dict(causal=True)),
    (25, 25, dict(window_size=(3, 2))),
    (25, 25, dict(softcap=5.0)),
    (25, 25, dict(return_lse=True)),
])
def test_sdpa_not_used_where_semantics_differ(rng, op, sdpa_spy, sq, sk, kw):
    q, k, v = _qkv(rng, 1, sq, sk, 2, 2, 8)
    res = op.forward(q, k, v, **kw)
    assert sdpa_spy == []
    out = res[0] if kw.get("return_lse") else res
    ref_out, _ = attention_ref(q, k, v, **{n: w for n, w in kw.items() if n != "return_lse"})
    assert np.abs(_np(out) - ref_out).max() <= 1e-5


@pytest.mark.parametrize("trial", range(3))
def test_band_visits_exactly_the_visible_blocks(rng, trial):
    """Every visible (query, key) pair lies in a visited key block, every visited block holds a visible pair, and
    a block is left unmasked only when all of it is visible."""
    sq, sk = (int(x) for x in rng.integers(1, 60, size=2))
    window = tuple(int(x) for x in rng.integers(-1, 12, size=2))
    q, k = rng.standard_normal((1, sq, 1, 4)), rng.standard_normal((1, sk, 1, 4))
    call = validate_forward(q, k, k, causal=bool(rng.integers(0, 2)), window_size=window)
    mask = visible_mask(sq, sk, call.window_left, call.window_right)
    band = tp_blocks.Band(call)
    bq, bk = (int(x) for x in rng.integers(1, 12, size=2))
    for q0 in range(0, sq, bq):
        q1 = min(q0 + bq, sq)
        covered = np.zeros(sk, bool)
        for k0, k1, need_mask in band.key_blocks(q0, q1, bk):
            tile = mask[q0:q1, k0:k1]
            assert tile.any()
            assert need_mask == (not tile.all())
            assert np.array_equal(band.visible(q0, q1, k0, k1, "cpu").numpy()[:, 0], tile)
            covered[k0:k1] = True
        assert not (mask[q0:q1].any(axis=0) & ~covered).any()


def test_score_blocks_stay_small_and_band_is_skipped(rng, op, monkeypatch):
    """Forward and backward never make a block of scores larger than the configured size, and a causal call
    computes about half the score matrix."""
    b, h, s = 1, 2, 150
    limit = b * h * 16 * 24
    monkeypatch.setattr(tp_blocks, "SCORE_BLOCK_ELEMENTS", limit)
    monkeypatch.setattr(tp_blocks, "CPU_BLOCK_K", 24)
    sizes = []
    real = tp_scores.block_scores

    def spy(*args, **kwargs):
        res = real(*args, **kwargs)
        sizes.append(res[0].numel())
        return res

    monkeypatch.setattr(tp_scores, "block_scores", spy)
    q, k, v = _qkv(rng, b, s, s, h, h, 8)
    out, lse = op.forward(q, k, v, causal=True, return_lse=True)
    assert max(sizes) <= limit
    assert sum(sizes) < 0.65 * b * h * s * s
    assert np.abs(_np(out) - attention_ref(q, k, v, causal=True)[0]).max() <= 1e-5
    sizes.clear()
    dout = torch.from_numpy(rng.standard_normal(q.shape)).float()
    grads = op.backward(dout, q, k, v, out, lse, causal=True)
    assert sizes and max(sizes) <= limit
    assert sum(sizes) < 0.65 * b * h * s * s
    for g, want in zip(grads, attention_ref_backward(dout, q, k, v, causal=True)):
        assert _rel_l2(g, want) <= 1e-5


def test_gqa_never_repeats_kv(rng, op, monkeypatch):
    """The blockwise path serves grouped-query attention by indexing, without copying K/V once per query head."""
    def refuse(*args, **kwargs):
        raise AssertionError("K/V repeated")

    q, k, v = _qkv(rng, 2, 21, 30, 6, 2, 8)
    dout = torch.from_numpy(rng.standard_normal(q.shape)).float()
    with monkeypatch.context() as m:
        for owner, name in ((torch, "repeat_interleave"), (torch.Tensor, "repeat_interleave"),
                            (torch.Tensor, "repeat"), (torch.Tensor, "expand")):
            m.setattr(owner, name, refuse)
        out, lse = op.forward(q, k, v, causal=True, return_lse=True)
        grads = op.backward(dout, q, k, v, out, lse, causal=True)
    assert np.abs(_np(out) - attention_ref(q, k, v, causal=True)[0]).max() <= 1e-5
    for g, want in zip(grads, attention_ref_backward(dout, q, k, v, causal=True)):
        assert _rel_l2(g, want) <= 1e-5


def test_bad_input_raises_before_work(rng, op):
    q, k, v = _qkv(rng, 1, 5, 5, 2, 2, 4)
    with pytest.raises(AttentionInputError, match="k: expected"):
        op.forward(q, k[0], v)
    with pytest.raises(AttentionInputError, match="dtype"):
        op.forward(q, k.double(), v)


def test_not_auto_selected_off_hip(rng, monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)
    be = rocm.RocmBackend()
    q, k, v = _qkv(rng, 1, 5, 5, 2, 2, 4)
    call = validate_forward(q, k, v)
    np_call = validate_forward(*(x.numpy() for x in (q, k, v)))
    if torch.version.hip is None:
        assert be.not_supported_reasons(call) == ["not a HIP device (torch.version.hip is None)"]
        assert "rocm" not in backend_registry.available("flash")
        text = backend_registry.get("flash").explain(q, k, v)
        assert "rocm [priority 40]: not a HIP device (torch.version.hip is None)" in text
    assert be.not_supported_reasons(np_call)[0].startswith("numpy input")
    assert be.not_supported_reasons(call, forced=True) == []
    assert be.not_supported_reasons(np_call, forced=True) == []


@pytest.fixture
def fake_hip(monkeypatch):
    """A HIP build of torch with a visible GPU. Returns a function that makes torch tensors report the device a
    HIP build gives its GPU tensors ("cuda"), so that CPU tensors can stand in for them."""
    import numba_flash.validation as validation

    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_device_of = validation.device_of

    def on_gpu():
        monkeypatch.setattr(validation, "device_of",
                            lambda x: "cuda" if isinstance(x, torch.Tensor) else real_device_of(x))

    return on_gpu


def test_fake_hip_build_selects_rocm(rng, fake_hip, monkeypatch):
    """On a HIP build of torch with a GPU, a tensor on that GPU goes to "rocm" without forcing, explain says why
    "cuda" (the numba kernels, NVIDIA only) and "cpu" were passed over, and flash_attn_func's forward and backward
    both run on "rocm"."""
    fake_hip()
    q, k, v = _qkv(rng, 1, 14, 19, 4, 2, 8)
    dispatcher = backend_registry.get("flash")
    text = dispatcher.explain(q, k, v, causal=True)
    head, rest = text.splitlines()[:2], text.splitlines()[2:]
    lines = {line.split()[0]: line for line in rest}
    assert head[1] == "chosen: rocm", text
    assert [line.split()[0] for line in rest] == ["rocm", "cuda", "cpu"]   # rocm is tried first on a HIP device
    assert lines["rocm"].endswith("can serve  <- chosen"), text
    assert "HIP (ROCm) tensors not supported (runs on NVIDIA CUDA)" in lines["cuda"], text
    assert "cuda tensors not supported" in lines["cpu"], text
    assert "rocm" in backend_registry.available("flash")
    out = dispatcher.forward(q, k, v, causal=True)
    assert np.abs(_np(out) - attention_ref(q, k, v, causal=True)[0]).max() <= 1e-5

    from numba_flash import flash_attn_func

    chosen = []
    real_select = backend_registry.Dispatcher.select

    def spy(self, call, backend=None):
        be = real_select(self, call, backend)
        chosen.append((be.name, call.is_backward))
        return be

    monkeypatch.setattr(backend_registry.Dispatcher, "select", spy)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    dout = torch.from_numpy(rng.standard_normal(q.shape)).float()
    flash_attn_func(*leaves, causal=True).backward(dout)
    assert chosen == [("rocm", False), ("rocm", True)]
    for leaf, want in zip(leaves, attention_ref_backward(dout, q, k, v, causal=True)):
        assert _rel_l2(leaf.grad, want) <= 1e-5


def test_fake_hip_build_leaves_host_tensors_to_cpu(rng, fake_hip, monkeypatch):
    # CPU tensors on a HIP build are not rocm's to take: the cpu backend serves them.
    q, k, v = _qkv(rng, 1, 6, 6, 2, 2, 4)
    text = backend_registry.get("flash").explain(q, k, v)
    lines = {line.split()[0]: line for line in text.splitlines()[2:]}
    assert text.splitlines()[1] == "chosen: cpu", text
    assert "cpu tensors not supported (runs on HIP GPUs unless forced with backend='rocm')" in lines["rocm"], text

    # A HIP build without a visible GPU is reported as such.
    fake_hip()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    call = validate_forward(q, k, v)
    assert rocm.RocmBackend().not_supported_reasons(call) == ["no HIP GPU (torch.cuda.is_available() is False)"]
    assert "rocm" not in backend_registry.available("flash")


def test_registering_and_numpy_dispatch_do_not_import_torch():
    code = ("import sys, numpy as np; from numba_flash import validate_forward; import backends.rocm as r; "
            "x = np.ones((1, 3, 1, 2), np.float32); "
            "call = validate_forward(x, x, x); "
            "reasons = r.RocmBackend().not_supported_reasons(call); "
            "assert reasons and reasons[0].startswith('numpy input'), reasons; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
