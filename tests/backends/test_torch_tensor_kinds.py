"""torch tensor kinds on the CPU backend and the ROCm (torch) path, forced: sparse and masked tensors are refused
with AttentionInputError, tensors with a pending negation (``x.conj().imag``) give the right answer without being
changed, and subclasses come back as the tensor type torch itself returns for them."""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backends import backend_registry  # noqa: E402
from numba_flash import AttentionInputError, attention_ref, attention_ref_backward  # noqa: E402

BACKENDS = ["cpu", "rocm"]


class TaggedTensor(torch.Tensor):
    """A subclass that keeps torch's __torch_function__: torch ops on it return TaggedTensor."""


@pytest.fixture(params=BACKENDS)
def op(request, monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)
    return backend_registry.get("flash", backend=request.param)


def _qkv(rng, b=2, sq=11, sk=13, hq=4, hkv=2, d=12):
    q = torch.from_numpy(rng.standard_normal((b, sq, hq, d)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((b, sk, hkv, d)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((b, sk, hkv, d)).astype(np.float32))
    dout = torch.from_numpy(rng.standard_normal((b, sq, hq, d)).astype(np.float32))
    return q, k, v, dout


def _np(t):
    return t.detach().as_subclass(torch.Tensor).to(torch.float64).numpy()


def _check_against_reference(out, lse, grads, q, k, v, dout, **kw):
    ref_out, ref_lse = attention_ref(q, k, v, **kw)
    assert np.abs(_np(out) - ref_out).max() <= 1e-5
    assert np.abs(_np(lse) - ref_lse).max() <= 1e-4
    for g, want in zip(grads, attention_ref_backward(dout, q, k, v, **kw)):
        assert np.linalg.norm(_np(g) - want) <= 1e-5 * np.linalg.norm(want)


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_sparse_inputs_are_refused(rng, op, arg, layout):
    q, k, v, _ = _qkv(rng)
    args = {"q": q, "k": k, "v": v}
    if layout == "sparse_csr":  # CSR is 2-D (or batched 2-D) only: a (B*S*H, D) matrix, refused before the shape
        with warnings.catch_warnings():  # "sparse CSR support is in beta"
            warnings.simplefilter("ignore", UserWarning)
            args[arg] = args[arg].reshape(-1, args[arg].shape[-1]).to_sparse_csr()
    else:
        args[arg] = args[arg].to_sparse()
    with pytest.raises(AttentionInputError, match=rf"^{arg}: expected a dense \(strided\) tensor .*got a tensor "
                                                  rf"with layout {layout}"):
        op.forward(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_masked_tensors_are_refused_by_name(rng, op, arg):
    """torch.masked's MaskedTensor: refused up front, by the face flash-attn users call too (torch otherwise fails
    deep in its dispatch with a TypeError that names no argument)."""
    import numba_flash

    masked = pytest.importorskip("torch.masked")
    q, k, v, _ = _qkv(rng)
    args = {"q": q, "k": k, "v": v}
    mask = torch.ones_like(args[arg], dtype=torch.bool)
    mask.view(-1)[int(rng.integers(mask.numel()))] = False
    with warnings.catch_warnings():   # "The PyTorch API of MaskedTensors is in prototype stage"
        warnings.simplefilter("ignore", UserWarning)
        args[arg] = masked.masked_tensor(args[arg], mask)
        pattern = rf"^{arg}: expected a plain tensor .*got a torch.masked.MaskedTensor"
        with pytest.raises(AttentionInputError, match=pattern):
            op.forward(args["q"], args["k"], args["v"])
        with pytest.raises(AttentionInputError, match=pattern):
            numba_flash.flash_attn_func(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("arg", ["dout", "out", "lse"])
def test_sparse_backward_arguments_are_refused(rng, op, arg):
    q, k, v, dout = _qkv(rng)
    out, lse = op.forward(q, k, v, return_lse=True)
    args = {"dout": dout, "out": out, "lse": lse}
    args[arg] = args[arg].to_sparse()
    with pytest.raises(AttentionInputError, match=rf"^{arg}: expected a dense \(strided\) tensor"):
        op.backward(args["dout"], q, k, v, args["out"], args["lse"])


@pytest.mark.parametrize("arg", ["q", "k", "v", "dout"])
def test_negative_bit_is_resolved_without_touching_the_input(rng, op, arg):
    """``x.conj().imag`` is a view with the negative bit set: numpy() and DLPack refuse it. The values it stands
    for (here, exactly the random tensor) must be used, and the view must keep its bit and its values."""
    q, k, v, dout = _qkv(rng)
    args = {"q": q, "k": k, "v": v, "dout": dout}
    plain = args[arg]
    neg_view = torch.complex(torch.zeros_like(plain), -plain).conj().imag  # imag of conj(-i x) = +x
    assert neg_view.is_neg() and torch.equal(neg_view, plain)
    args[arg] = neg_view
    out, lse = op.forward(args["q"], args["k"], args["v"], causal=True, return_lse=True)
    grads = op.backward(args["dout"], args["q"], args["k"], args["v"], out, lse, causal=True)
    assert neg_view.is_neg() and torch.equal(neg_view, plain), "the input is never modified"
    _check_against_reference(out, lse, grads, q, k, v, dout, causal=True)


def test_negative_bit_on_out_and_lse(rng, op):
    q, k, v, dout = _qkv(rng)
    out, lse = op.forward(q, k, v, return_lse=True)
    neg_out = torch.complex(torch.zeros_like(out), -out).conj().imag
    neg_lse = torch.complex(torch.zeros_like(lse), -lse).conj().imag
    assert neg_out.is_neg() and neg_lse.is_neg()
    grads = op.backward(dout, q, k, v, neg_out, neg_lse)
    for g, want in zip(grads, op.backward(dout, q, k, v, out, lse)):
        assert torch.equal(g, want)


def test_subclass_comes_back_as_the_subclass(rng, op):
    q, k, v, dout = _qkv(rng)
    tq, tk, tv, tdout = (x.as_subclass(TaggedTensor) for x in (q, k, v, dout))
    out, lse = op.forward(tq, tk, tv, causal=True, return_lse=True)
    assert type(out) is TaggedTensor and type(lse) is TaggedTensor
    grads = op.backward(tdout, tq, tk, tv, out, lse, causal=True)
    assert all(type(g) is TaggedTensor for g in grads)
    assert type(op.forward(tq, tk, tv)) is TaggedTensor  # rocm: the SDPA path too
    _check_against_reference(out, lse, grads, q, k, v, dout, causal=True)


def test_parameter_gives_plain_tensors(rng, op):
    """nn.Parameter disables __torch_function__, so torch ops on it return plain tensors: so does attention."""
    q, k, v, _ = _qkv(rng)
    out = op.forward(torch.nn.Parameter(q), torch.nn.Parameter(k), torch.nn.Parameter(v))
    assert type(out) is torch.Tensor and not out.requires_grad
    assert np.abs(_np(out) - attention_ref(q, k, v)[0]).max() <= 1e-5


def test_reference_takes_sparse_and_negative_bit(rng):
    """The oracle copies every input to float64 anyway, so it accepts these kinds as they are."""
    q, k, v, _ = _qkv(rng)
    want = attention_ref(q, k, v)[0]
    neg_q = torch.complex(torch.zeros_like(q), -q).conj().imag
    np.testing.assert_array_equal(attention_ref(neg_q, k.to_sparse(), v)[0], want)


def test_array_kinds_need_no_torch():
    """Recognising a torch tensor must not import torch: numpy calls run where torch is not imported."""
    code = ("import sys, numpy as np\n"
            "import numba_flash, backends\n"
            "from numba_flash.validation import validate_forward\n"
            "x = np.zeros((1, 2, 1, 4), np.float32)\n"
            "validate_forward(x, x, x)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.cudasim
def test_cuda_backend_keeps_subclasses_and_resolves_negative_bits(rng):
    """The CUDA backend (under the simulator, torch CPU tensors are copied through the device) takes the same
    kinds: a subclass comes back as itself, a tensor with the negative bit gives the answer for its values."""
    from numba_flash.cuda import tile_config_override

    op = backend_registry.get("flash", backend="cuda")
    q, k, v, dout = _qkv(rng, b=1, sq=5, sk=7, hq=2, hkv=1, d=8)
    tq, tk, tv, tdout = (x.as_subclass(TaggedTensor) for x in (q, k, v, dout))
    with tile_config_override(block_m=8, block_n=8, threads=16):
        out, lse = op.forward(tq, tk, tv, causal=True, return_lse=True)
        assert type(out) is TaggedTensor and type(lse) is TaggedTensor
        grads = op.backward(tdout, tq, tk, tv, out, lse, causal=True)
        assert all(type(g) is TaggedTensor for g in grads)
        _check_against_reference(out, lse, grads, q, k, v, dout, causal=True)
        neg_k = torch.complex(torch.zeros_like(k), -k).conj().imag  # imag of conj(-i k) = +k
        assert neg_k.is_neg() and torch.equal(neg_k, k)
        got = op.forward(q, neg_k, v, causal=True)
    assert np.abs(_np(got) - attention_ref(q, k, v, causal=True)[0]).max() <= 1e-5
