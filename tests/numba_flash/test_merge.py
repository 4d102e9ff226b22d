"""merge_attention_states: the keys of a call split into disjoint sets, each set's attention computed on its own
(by the float64 reference or the CPU backend), merged, equals the whole call's reference; rows that see no key of a
part, or of either, NaN rows, stability, layouts, bad input, torch tensors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from numba_flash import AttentionInputError, attention_ref, merge_attention_states
from numba_flash.backend_registry import ENV_VAR, get
from numba_flash.semantics import effective_window


@pytest.fixture(autouse=True)
def _no_env_backend(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def _qkv(rng, b, sq, sk, hq, hkv, d):
    return (rng.standard_normal((b, sq, hq, d)), rng.standard_normal((b, sk, hkv, d)),
            rng.standard_normal((b, sk, hkv, d)))


def _part_window(sk, lo, hi, causal, window_size):
    """The window that keys [lo, hi) alone need, called as a (B, hi - lo) call, for the rows of the whole call to
    see exactly the keys of that range they see in the whole call. Causal and windows align to the bottom-right
    corner, which moves by Sk - hi when the keys after hi are cut off."""
    left, right = effective_window(causal, window_size)
    shift = sk - hi
    if left >= 0:
        assert left >= shift, "this split cannot be expressed as a window; pick another"
        left -= shift
    return (left, right if right < 0 else right + shift)


def _ref_part(q, k, v, lo, hi, causal=False, window_size=(-1, -1)):
    win = _part_window(k.shape[1], lo, hi, causal, window_size)
    return attention_ref(q, k[:, lo:hi], v[:, lo:hi], window_size=win)


CASES = {
    "gqa": dict(shape=(2, 13, 23, 6, 2, 7), kw={}, split=9),
    "causal_sq_lt_sk": dict(shape=(1, 11, 29, 4, 1, 5), kw=dict(causal=True), split=20),
    "causal_sq_gt_sk": dict(shape=(2, 19, 11, 3, 3, 6), kw=dict(causal=True), split=5),
    "window": dict(shape=(1, 17, 23, 4, 2, 9), kw=dict(window_size=(9, 2)), split=15),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_two_key_ranges_merge_to_the_whole_reference(rng, case):
    q, k, v = _qkv(rng, *case["shape"])
    kw, split, sk = case["kw"], case["split"], case["shape"][2]
    want_out, want_lse = attention_ref(q, k, v, **kw)
    part_a, part_b = _ref_part(q, k, v, 0, split, **kw), _ref_part(q, k, v, split, sk, **kw)
    if kw.get("causal"):
        # what the case is for: rows that see no key of the later part (and, for Sq > Sk, of either)
        assert np.isposinf(part_b[1]).any() and np.isfinite(part_b[1]).any()
    out, lse = merge_attention_states(*part_a, *part_b)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13, atol=0)   # +inf where the whole row sees nothing
    assert np.array_equal(np.isposinf(lse), np.isposinf(want_lse))
    assert np.all(out[np.isposinf(want_lse).transpose(0, 2, 1)] == 0)

    # float32 parts: the merge runs in float32 and stays at float32 rounding
    out32, lse32 = merge_attention_states(*(x.astype(np.float32) for x in (*part_a, *part_b)))
    assert out32.dtype == np.float32 and lse32.dtype == np.float32
    np.testing.assert_allclose(out32, want_out, rtol=0, atol=1e-6)
    np.testing.assert_allclose(lse32, want_lse, rtol=1e-6, atol=1e-6)


def test_interleaved_key_sets_merge_to_the_whole_reference(rng):
    """Any disjoint split, not only ranges (without a mask, attention does not depend on the order of the keys)."""
    q, k, v = _qkv(rng, 2, 9, 31, 4, 2, 11)
    keys = rng.permutation(31)
    set_a, set_b = np.sort(keys[:12]), np.sort(keys[12:])
    part_a = attention_ref(q, k[:, set_a], v[:, set_a])
    part_b = attention_ref(q, k[:, set_b], v[:, set_b])
    out, lse = merge_attention_states(*part_a, *part_b)
    want_out, want_lse = attention_ref(q, k, v)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_backend_halves_merge_to_the_whole_reference(rng, causal):
    q, k, v = (x.astype(np.float32) for x in _qkv(rng, 2, 21, 27, 6, 3, 13))
    op = get("flash", backend="cpu")
    split = 14
    parts = [op.forward(q, k[:, lo:hi], v[:, lo:hi], return_lse=True,
                        window_size=_part_window(27, lo, hi, causal, (-1, -1)))
             for lo, hi in ((0, split), (split, 27))]
    if causal:
        assert np.isposinf(parts[1][1]).any()
    out, lse = merge_attention_states(*parts[0], *parts[1])
    want_out, want_lse = attention_ref(q, k, v, causal=causal)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert np.abs(out - want_out).max() <= 1e-5
    assert np.abs(lse - want_lse).max() <= 1e-5


def test_float16_outputs_stay_float16(rng):
    q, k, v = _qkv(rng, 1, 15, 19, 2, 2, 8)
    part_a, part_b = _ref_part(q, k, v, 0, 7, causal=True), _ref_part(q, k, v, 7, 19, causal=True)
    out, lse = merge_attention_states(part_a[0].astype(np.float16), part_a[1].astype(np.float32),
                                      part_b[0].astype(np.float16), part_b[1].astype(np.float32))
    assert out.dtype == np.float16 and lse.dtype == np.float32
    want_out, want_lse = attention_ref(q, k, v, causal=True)
    assert np.linalg.norm(out - want_out) <= 2e-3 * np.linalg.norm(want_out)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)


def test_merging_is_associative_over_three_parts(rng):
    q, k, v = _qkv(rng, 2, 14, 25, 4, 2, 6)
    a, b, c = (_ref_part(q, k, v, lo, hi, causal=True) for lo, hi in ((0, 8), (8, 17), (17, 25)))
    left = merge_attention_states(*merge_attention_states(*a, *b), *c)
    right = merge_attention_states(*a, *merge_attention_states(*b, *c))
    want_out, want_lse = attention_ref(q, k, v, causal=True)
    for out, lse in (left, right):
        np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-13, atol=0)
    np.testing.assert_allclose(left[0], right[0], rtol=0, atol=1e-13)


def test_nan_rows_follow_the_whole_reference(rng):
    """A NaN in q poisons its row; an inf in v, the out of the rows that see that key (their lse stays finite); a
    NaN in k, the rows that see that key (NaN lse). The merged parts agree with the whole call row by row: nothing
    hidden, nothing spread."""
    q, k, v = _qkv(rng, 1, 12, 16, 2, 1, 5)     # causal: row i sees keys j <= i + 4
    q[0, 3, 1] = np.nan
    v[0, 5, 0, 1] = np.inf      # part a, seen by rows 1 and up
    k[0, 14, 0, 2] = np.nan     # part b, seen by rows 10 and up
    part_a, part_b = _ref_part(q, k, v, 0, 9, causal=True), _ref_part(q, k, v, 9, 16, causal=True)
    out, lse = merge_attention_states(*part_a, *part_b)
    want_out, want_lse = attention_ref(q, k, v, causal=True)
    assert np.isnan(want_lse[0, :, 10:]).all() and np.isfinite(want_lse[0, 0, :10]).all()
    assert np.isnan(want_out[0, 1:10, 0, 1]).all() and np.isfinite(want_out[0, 0]).all()
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-12)      # NaN exactly where the reference has it
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13, atol=0)


def test_row_rules_on_built_states(rng):
    """Row by row (B=1, H=1, S=6): a part with lse +inf weighs nothing whatever its out row holds; both +inf give
    0 and +inf; a NaN lse on either side gives a NaN row; lses far apart or huge neither overflow nor lose the
    larger part."""
    inf, nan = np.inf, np.nan
    lse_a = np.array([[[inf, inf, nan, 1.5, 800.0, 1e300]]])
    lse_b = np.array([[[inf, 0.25, -2.0, nan, -800.0, 1e300]]])
    out_a = rng.standard_normal((1, 6, 1, 3))
    out_b = rng.standard_normal((1, 6, 1, 3))
    out_a[0, 0] = out_a[0, 1] = nan     # ignored: those rows saw no key of part a
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert np.all(out[0, 0] == 0) and lse[0, 0, 0] == inf
    assert np.array_equal(out[0, 1], out_b[0, 1]) and lse[0, 0, 1] == 0.25
    assert np.isnan(out[0, 2:4]).all() and np.isnan(lse[0, 0, 2:4]).all()
    assert np.array_equal(out[0, 4], out_a[0, 4]) and lse[0, 0, 4] == 800.0
    np.testing.assert_allclose(out[0, 5], (out_a[0, 5] + out_b[0, 5]) / 2, rtol=1e-15, atol=0)
    assert lse[0, 0, 5] == 1e300    # + log 2, below float64's resolution there


def test_packed_layout_matches_the_batched_one(rng):
    """(T, H, D) with lse (H, T), as varlen returns them: the same merge as (B, S, H, D) with (B, H, S)."""
    q, k, v = _qkv(rng, 3, 7, 10, 4, 2, 5)
    part_a, part_b = _ref_part(q, k, v, 0, 6, causal=True), _ref_part(q, k, v, 6, 10, causal=True)
    want_out, want_lse = merge_attention_states(*part_a, *part_b)

    def pack(out, lse):
        return out.reshape(21, 4, 5), np.ascontiguousarray(lse.transpose(1, 0, 2).reshape(4, 21))

    out, lse = merge_attention_states(*pack(*part_a), *pack(*part_b))
    packed_out, packed_lse = pack(want_out, want_lse)
    assert out.shape == (21, 4, 5) and lse.shape == (4, 21)
    np.testing.assert_allclose(out, packed_out, rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(lse, packed_lse, rtol=1e-15, atol=0)


def test_inputs_are_not_modified(rng):
    q, k, v = _qkv(rng, 1, 9, 12, 2, 2, 4)
    states = [x.astype(np.float32) for x in (*_ref_part(q, k, v, 0, 5, causal=True),
                                             *_ref_part(q, k, v, 5, 12, causal=True))]
    states[1][0, 0, 2] = np.nan
    before = [x.copy() for x in states]
    merge_attention_states(*states)
    for x, x0 in zip(states, before):
        assert np.array_equal(x, x0, equal_nan=True)


def _states(rng, out_shape=(2, 5, 3, 4)):
    """Random float32 (out_a, lse_a, out_b, lse_b) for an out shape of 3 or 4 dimensions."""
    lse_shape = (out_shape[0], out_shape[2], out_shape[1]) if len(out_shape) == 4 else out_shape[1::-1]
    return [rng.standard_normal(shape).astype(np.float32) for shape in (out_shape, lse_shape) * 2]


BAD = {
    "out_b_shape": (lambda s: s.__setitem__(2, s[2][:, :4]), r"out_b: expected the shape of out_a \(2, 5, 3, 4\)"),
    "lse_layout_bsh": (lambda s: s.__setitem__(1, s[1].transpose(0, 2, 1)),
                       r"lse_a: expected shape \(B, H, S\) = \(2, 3, 5\) .* got shape \(2, 5, 3\)"),
    "out_2d": (lambda s: s.__setitem__(0, s[0][0, 0]), r"out_a: expected 4 dimensions \(B, S, H, D\), or 3"),
    "int_out": (lambda s: s.__setitem__(0, s[0].astype(np.int32)), r"out_a: expected a floating dtype.*int32"),
    "int_lse": (lambda s: s.__setitem__(1, s[1].astype(np.int64)), r"lse_a: expected a floating dtype.*int64"),
    "mixed_lse_dtypes": (lambda s: s.__setitem__(3, s[3].astype(np.float64)),
                         r"lse_b: expected the dtype of lse_a \(float32\), got dtype float64"),
    "mixed_out_dtypes": (lambda s: s.__setitem__(2, s[2].astype(np.float16)),
                         r"out_b: expected the dtype of out_a \(float32\), got dtype float16"),
    "list": (lambda s: s.__setitem__(0, s[0].tolist()), r"out_a: expected a numpy array or a torch tensor"),
    "lse_list": (lambda s: s.__setitem__(1, s[1].tolist()), r"lse_a: expected the same array kind as out_a"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_input_names_the_argument(rng, case):
    mutate, match = case
    states = _states(rng)
    mutate(states)
    with pytest.raises(AttentionInputError, match=match):
        merge_attention_states(*states)


def test_packed_lse_must_be_heads_by_tokens(rng):
    out, lse, _, _ = _states(rng, (11, 3, 4))
    with pytest.raises(AttentionInputError, match=r"lse_b: expected shape \(H, T\) = \(3, 11\)"):
        merge_attention_states(out, lse, out, lse.T)


def test_numpy_merge_does_not_import_torch(tmp_path):
    code = ("import sys, numpy as np, numba_flash\n"
            "s = np.ones((1, 2, 1, 3)), np.zeros((1, 1, 2))\n"
            "out, lse = numba_flash.merge_attention_states(*s, *s)\n"
            "assert np.allclose(out, 1) and np.allclose(lse, np.log(2))\n"
            "assert 'torch' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


# ---- torch tensors -------------------------------------------------------------------------------------------


def _devices():
    torch = pytest.importorskip("torch")
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_torch_tensors_round_trip(rng, dtype):
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(rng, 2, 10, 13, 4, 2, 6)
    parts = [*_ref_part(q, k, v, 0, 6, causal=True), *_ref_part(q, k, v, 6, 13, causal=True)]
    want_out, want_lse = attention_ref(q, k, v, causal=True)
    tdtype = getattr(torch, dtype)
    lse_dtype = torch.float64 if dtype == "float64" else torch.float32
    for device in _devices():
        states = [torch.from_numpy(x).to(device=device, dtype=tdtype if i % 2 == 0 else lse_dtype)
                  for i, x in enumerate(parts)]
        before = [x.clone() for x in states]
        out, lse = merge_attention_states(*states)
        assert type(out) is torch.Tensor and out.device == states[0].device and out.dtype == tdtype
        assert lse.device == states[0].device and lse.dtype == lse_dtype and lse.shape == want_lse.shape
        got_out, got_lse = out.double().cpu().numpy(), lse.double().cpu().numpy()
        if dtype == "bfloat16":
            assert np.linalg.norm(got_out - want_out) <= 1.6e-2 * np.linalg.norm(want_out)
        else:
            np.testing.assert_allclose(got_out, want_out, rtol=0, atol=1e-6 if dtype == "float32" else 1e-12)
        np.testing.assert_allclose(got_lse, want_lse, rtol=1e-13 if dtype == "float64" else 1e-6, atol=0)
        for x, x0 in zip(states, before):
            assert torch.equal(x, x0)


def test_torch_and_numpy_merges_agree_on_nan_and_empty_rows(rng):
    torch = pytest.importorskip("torch")
    states = _states(rng, (2, 7, 3, 5))
    states[1][0, 1, :3] = np.inf
    states[3][0, 1, 1:4] = np.inf
    states[3][1, 2, 5] = np.nan
    want_out, want_lse = merge_attention_states(*states)
    out, lse = merge_attention_states(*(torch.from_numpy(x) for x in states))
    # Two float32 computations whose exp and sums round differently: a few ulps of the O(1) terms, so an absolute
    # slack (an output near 0 is a difference of such terms).
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-6, atol=1e-6)
    assert torch.isnan(out[1, 5, 2]).all() and (out[0, 1:3, 1] == 0).all()


def test_torch_gradients_are_finite_through_empty_rows(rng):
    """Autograd goes through the torch merge; a part with +inf lse gets gradient 0, not NaN."""
    torch = pytest.importorskip("torch")
    states = [torch.from_numpy(x.astype(np.float64)) for x in _states(rng, (1, 4, 2, 3))]
    states[1][0, 1, 2] = np.inf
    states = [x.requires_grad_() for x in states]
    assert torch.autograd.gradcheck(lambda *s: merge_attention_states(*s), states)
    out, lse = merge_attention_states(*states)
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in states)
    assert states[0].grad[0, 2, 1].eq(0).all()


def test_mixed_numpy_and_torch_is_refused(rng):
    torch = pytest.importorskip("torch")
    states = _states(rng)
    states[3] = torch.from_numpy(states[3])
    with pytest.raises(AttentionInputError,
                       match=r"lse_b: expected the same array kind as out_a \(numpy\), got torch"):
        merge_attention_states(*states)
    states = [torch.from_numpy(x) for x in _states(rng)]
    states[2] = states[2].numpy()
    with pytest.raises(AttentionInputError, match=r"out_b: expected the same array kind as out_a \(torch\)"):
        merge_attention_states(*states)
