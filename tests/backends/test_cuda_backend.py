"""CudaBackend: array kinds, dispatch rules and reasons. The `cudasim` tests run the kernels under the Numba CUDA
simulator (own process, NUMBA_ENABLE_CUDASIM=1); the others run in the normal process, where there is no GPU."""

import numpy as np
import pytest

from backends import backend_registry
from backends.cuda import BF16_REASON, HOST_REASON, SIM_REASON, CudaBackend
from numba_flash import AttentionInputError, attention_ref
from numba_flash.cuda import TileOverride, tile_config_override
from numba_flash.validation import validate_forward

cudasim = pytest.mark.cudasim


def _qkv(rng, sq=11, sk=13, hq=2, hkv=1, d=8, dtype=np.float32):
    return (rng.standard_normal((1, sq, hq, d)).astype(dtype), rng.standard_normal((1, sk, hkv, d)).astype(dtype),
            rng.standard_normal((1, sk, hkv, d)).astype(dtype))


# ---- normal process (no GPU, no simulator) ----

def test_no_gpu_reasons_and_not_available(rng):
    be = CudaBackend()
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


def test_bfloat16_reason(rng):
    torch = pytest.importorskip("torch")
    be = CudaBackend()
    q, k, v = (torch.from_numpy(x).to(torch.bfloat16) for x in _qkv(rng))
    reasons = be.not_supported_reasons(validate_forward(q, k, v), forced=True)
    assert BF16_REASON in reasons
    assert "cpu tensors not supported (runs on cuda)" in reasons


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
