"""CudaBackend: array kinds, dispatch rules and reasons. The `cudasim` tests run the kernels under the Numba CUDA
simulator (own process, NUMBA_ENABLE_CUDASIM=1); the others run in the normal process, where there is no GPU."""

from dataclasses import replace

import numpy as np
import pytest

import backends.cuda as cuda_backend
from backends import backend_registry
from backends.cuda import BF16_CAI_REASON, BF16_CC_REASON, BF16_HOST_REASON, HOST_REASON, SIM_REASON, CudaBackend
from backends.cuda_io import torch_bits
from numba_flash import AttentionInputError, attention_ref, attention_ref_backward
from numba_flash.cuda import TileOverride, tile_config_override
from numba_flash.validation import validate_forward

cudasim = pytest.mark.cudasim


def _qkv(rng, sq=11, sk=13, hq=2, hkv=1, d=8, dtype=np.float32):
    return (rng.standard_normal((1, sq, hq, d)).astype(dtype), rng.standard_normal((1, sk, hkv, d)).astype(dtype),
            rng.standard_normal((1, sk, hkv, d)).astype(dtype))


# ---- normal process (no GPU, no simulator) ----

def test_no_gpu_reasons_and_not_available(rng):
    be = CudaBackend()
    if be._probe() == (False, None):
        pytest.skip("a CUDA GPU is present: this is the no-GPU machine's test")
    reasons = be.unavailable_reasons(forced=False)
    assert reasons and ("no CUDA GPU" in reasons[0] or "cannot be imported" in reasons[0])
    assert be.unavailable_reasons(forced=True) == reasons     # forcing does not conjure a GPU
    assert "cuda" not in backend_registry.available("flash")
    assert "cuda" in backend_registry.names("flash")
    assert CudaBackend.PRIORITY == 30


def test_reasons_for_calls(rng):
    be = CudaBackend()
    q, k, v = _qkv(rng)
    call = validate_forward(q, k, v)
    assert HOST_REASON in be.not_supported_reasons(call, forced=False)
    assert HOST_REASON not in be.not_supported_reasons(call, forced=True)
    call64 = validate_forward(*(x.astype(np.float64) for x in (q, k, v)))
    assert "float64 not supported" in be.not_supported_reasons(call64, forced=True)


def _bf16_call(rng, **kw):
    torch = pytest.importorskip("torch")
    return validate_forward(*(torch.from_numpy(x).to(torch.bfloat16) for x in _qkv(rng)), **kw)


def test_bfloat16_reasons(rng):
    be = CudaBackend()
    call = _bf16_call(rng)
    # bfloat16 itself is supported: CPU tensors are turned down for where they live, not for their dtype.
    assert be.not_supported_reasons(call, forced=True)[0] == "cpu tensors not supported (runs on cuda)"
    assert not any("bfloat16" in r for r in be.not_supported_reasons(call, forced=True))
    # numpy has no bfloat16 (an ml_dtypes array would say "bfloat16"), nor has __cuda_array_interface__.
    host = replace(validate_forward(*_qkv(rng)), dtype="bfloat16")
    assert BF16_HOST_REASON in be.not_supported_reasons(host, forced=True)
    cai = replace(host, kind="cuda_array", device="cuda")
    assert BF16_CAI_REASON in be.not_supported_reasons(cai, forced=True)


@pytest.mark.parametrize("cc,ok", [((7, 5), False), ((7, 0), False), ((8, 0), True), ((8, 9), True), ((9, 0), True)])
def test_bfloat16_needs_compute_capability_8(rng, monkeypatch, cc, ok):
    # Fake a GPU of compute capability cc holding the tensors: no GPU here, and the simulator has no cc.
    be = CudaBackend()
    monkeypatch.setattr(be, "_probe", lambda: (False, None))
    monkeypatch.setattr(cuda_backend, "_gpu_compute_capability", lambda x: cc)
    call = replace(_bf16_call(rng, causal=True), device="cuda")
    want = [] if ok else [BF16_CC_REASON.format(need="8.0", have=f"{cc[0]}.{cc[1]}")]
    assert be.not_supported_reasons(call, forced=False) == want
    assert be.not_supported_reasons(call, forced=True) == want
    f16 = replace(call, dtype="float16")
    assert be.not_supported_reasons(f16) == []      # only bfloat16 depends on the compute capability


def test_bfloat16_tensors_reach_kernels_as_int16_views():
    torch = pytest.importorskip("torch")
    t = torch.randn(2, 7, 3, 5).to(torch.bfloat16).transpose(1, 2)   # non-contiguous
    bits = torch_bits(t)
    assert bits.dtype == torch.int16 and bits.shape == t.shape and bits.stride() == t.stride()
    assert bits.data_ptr() == t.data_ptr()                              # zero-copy
    assert torch.equal(bits.view(torch.bfloat16), t)
    h = torch.randn(3, 4).half()
    assert torch_bits(h) is h


def test_explain_lists_cuda_reason(rng):
    text = backend_registry.get("flash").explain(*_qkv(rng))
    assert "cuda [priority 30]:" in text


# ---- simulator ----

@cudasim
def test_simulator_never_auto_selected(rng):
    be = CudaBackend()
    assert be.unavailable_reasons(forced=False) == [SIM_REASON]
    assert be.unavailable_reasons(forced=True) == []
    assert "cuda" not in backend_registry.available("flash")
    q, k, v = _qkv(rng)
    assert backend_registry.get("flash").select(validate_forward(q, k, v)).name != "cuda"


@cudasim
def test_forced_numpy_in_numpy_out_inputs_untouched(rng):
    q, k, v = _qkv(rng, sq=17, sk=9, hq=3, hkv=3, d=5)
    copies = [x.copy() for x in (q, k, v)]
    with tile_config_override(block_m=8, block_n=8, threads=16):
        out, lse = backend_registry.get("flash").forward(q, k, v, causal=True, return_lse=True, backend="cuda")
        dout = rng.standard_normal(q.shape).astype(np.float32)
        dcopy, ocopy, lcopy = dout.copy(), out.copy(), lse.copy()
        grads = backend_registry.get("flash", backend="cuda").backward(dout, q, k, v, out, lse, causal=True)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    assert out.shape == q.shape and lse.shape == (1, 3, 17)
    assert all(isinstance(g, np.ndarray) for g in grads)
    for x, c in zip((q, k, v, dout, out, lse), copies + [dcopy, ocopy, lcopy]):
        assert np.array_equal(x, c)
    ref, _ = attention_ref(q, k, v, causal=True)
    assert np.max(np.abs(out - ref)) <= 1e-5


@cudasim
def test_calls_launch_without_numba_low_occupancy_warnings_and_restore_the_switch(rng, monkeypatch):
    # On an H200 every small call warned "Grid size 20 will likely result in GPU under-utilization": the user's
    # shape, not theirs to tune. numba reads its switch at each launch; the backend's calls hold it off.
    from numba.core import config as numba_config

    import numba_flash.cuda.host.flash as flash

    seen = []
    for name in ("flash_forward", "flash_backward"):
        real = getattr(flash, name)

        def spy(*args, _real=real, **kw):
            seen.append(numba_config.CUDA_LOW_OCCUPANCY_WARNINGS)
            return _real(*args, **kw)

        monkeypatch.setattr(flash, name, spy)
    before = numba_config.CUDA_LOW_OCCUPANCY_WARNINGS
    assert before   # numba-cuda's default: on
    q, k, v = _qkv(rng, sq=9, sk=7)
    op = backend_registry.get("flash", backend="cuda")
    with tile_config_override(block_m=8, block_n=8, threads=16):
        out, lse = op.forward(q, k, v, return_lse=True)
        op.backward(rng.standard_normal(q.shape).astype(np.float32), q, k, v, out, lse)
    assert seen == [0, 0]
    assert numba_config.CUDA_LOW_OCCUPANCY_WARNINGS == before


@cudasim
def test_numba_device_arrays_in_device_arrays_out(rng):
    from numba import cuda

    q, k, v = _qkv(rng)
    dq_, dk_, dv_ = (cuda.to_device(x) for x in (q, k, v))
    be = CudaBackend(config=TileOverride(block_m=8, block_n=8, threads=16))
    backend_registry.register("flash", "cuda_small_tiles", be)
    try:
        out = backend_registry.get("flash", backend="cuda_small_tiles").forward(dq_, dk_, dv_)
    finally:
        backend_registry.unregister("flash", "cuda_small_tiles")
    assert getattr(type(out), "__cuda_ndarray__", False)
    ref, _ = attention_ref(q, k, v)
    assert np.max(np.abs(out.copy_to_host() - ref)) <= 1e-5
    assert np.array_equal(dq_.copy_to_host(), q)


@cudasim
def test_tile_override_that_does_not_fit_raises(rng):
    q, k, v = _qkv(rng, d=200)
    op = backend_registry.get("flash", backend="cuda")
    with tile_config_override(block_m=128, block_n=128):
        with pytest.raises(AttentionInputError, match="shared memory"):
            op.forward(q, k, v)


def _naive_torch(q, k, v, causal):
    """Attention computed by torch entirely in q's dtype, layout (B, H, S, D): the bar for low-precision error."""
    import torch

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq), float("-inf"))
    # Rows that see no key: softmax gives NaN, the contract 0.
    return torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0) @ v


@cudasim
def test_bfloat16_torch_tensors_forward_backward(rng):
    # Under the simulator torch CPU tensors stand in for CUDA ones (copied in and out). Ragged tiles, causal with
    # Sq > Sk (the first rows see nothing), GQA, layout bhsd.
    torch = pytest.importorskip("torch")
    b, sq, sk, hq, hkv, d = 1, 17, 11, 2, 1, 9

    def bf16(*shape):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch.bfloat16)

    q, k, v, dout = bf16(b, hq, sq, d), bf16(b, hkv, sk, d), bf16(b, hkv, sk, d), bf16(b, hq, sq, d)
    copies = [x.clone() for x in (q, k, v, dout)]
    op = backend_registry.get("flash", backend="cuda")
    with tile_config_override(block_m=8, block_n=8, threads=16):
        out, lse = op.forward(q, k, v, causal=True, layout="bhsd", return_lse=True)
        lse_copy, out_copy = lse.clone(), out.clone()
        grads = op.backward(dout, q, k, v, out, lse, causal=True, layout="bhsd")
    for x, c in zip((q, k, v, dout, out, lse), copies + [out_copy, lse_copy]):
        assert torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
                           c.view(torch.int16) if c.dtype == torch.bfloat16 else c)

    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, sq)
    ref, ref_lse = attention_ref(q, k, v, causal=True, layout="bhsd")
    assert torch.all(out[:, :, :sq - sk] == 0) and torch.all(lse[:, :, :sq - sk] == float("inf"))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse.numpy()[fin], ref_lse[fin], rtol=0, atol=1e-5)
    err = _rel_l2(out.float().numpy(), ref)
    naive_err = _rel_l2(_naive_torch(q, k, v, causal=True).float().numpy(), ref)
    assert err <= 1.6e-2 and err <= 2 * naive_err, (err, naive_err)

    for got, want, like in zip(grads, attention_ref_backward(dout, q, k, v, causal=True, layout="bhsd"), (q, k, v)):
        assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16 and got.shape == like.shape
        assert torch.all(torch.isfinite(got))
        assert _rel_l2(got.float().numpy(), want) <= 1.6e-2


def _rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_rotary_of_bfloat16_gpu_tensors_rotates_values_not_bits(rng):
    # The torch-on-GPU branch of with_kvcache's rotary and append, run here on CPU tensors (torch computes the same
    # on either), against the host branch on copies: it once rotated bfloat16 tensors viewed as their int16 bits.
    torch = pytest.importorskip("torch")
    from kvcache_cases import as_torch, random_case

    from numba_flash.kvcache import validate_kvcache

    args = random_case(rng, batch=2, sq=2, hq=2, hkv=1, d=8, capacity=11, s_new=2, paged=True, page=4)

    def bf16_call():
        tensors = {n: (t.bfloat16() if t.dtype.is_floating_point else t) for n, t in as_torch(args).items()}
        return validate_kvcache(**{n: t.clone() for n, t in tensors.items()}, causal=True)

    gpu, host = replace(bf16_call(), device="cuda"), bf16_call()
    q_gpu, q_host = CudaBackend._rotate_and_append(gpu), CudaBackend._rotate_and_append(host)
    assert q_gpu.dtype == torch.bfloat16
    np.testing.assert_allclose(q_gpu.float().numpy(), q_host.float().numpy(), rtol=1.6e-2, atol=1.6e-2)
    for name in ("k_cache", "v_cache"):
        np.testing.assert_allclose(getattr(gpu, name).float().numpy(), getattr(host, name).float().numpy(),
                                   rtol=1.6e-2, atol=1.6e-2)
