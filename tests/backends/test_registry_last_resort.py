"""The last resort: torch tensors on a GPU that no backend serves as asked go to the torch path on that device.

On an NVIDIA GPU the cuda kernels take head dims past 256 from compute capability 8.0 on only (the backward to 512)
and leave the gradient of a shared attn_bias to others, and the torch path (backend 'rocm') steps in for a HIP GPU
only: before this, Gemma's D = 512, MLA's 576 / 512, and a learned bias through ``flash_attn_func`` raised
NoBackendError on NVIDIA tensors the kernels did not serve. There is no GPU here, so the calls are
validated on CPU tensors and then moved onto device 'cuda' in their description (``dataclasses.replace``), as the
cuda backend's own tests do; the real backends answer them.
"""

from dataclasses import replace

import numpy as np
import pytest

import backends.cuda as cuda_backend
from backends import backend_registry
from backends.cuda import CudaBackend
from backends.rocm import RocmBackend
from numba_flash import NoBackendError
from numba_flash.errors import BackendDeclined
from numba_flash.validation import validate_backward, validate_forward

torch = pytest.importorskip("torch")


@pytest.fixture
def op(monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)
    return backend_registry.get("flash")


def _tensors(rng, d=64, dv=None, sq=7, sk=9):
    shapes = ((1, sq, 2, d), (1, sk, 1, d), (1, sk, 1, dv or d))
    return [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in shapes]


def _on_gpu(call):
    return replace(call, device="cuda")


def _gpu_that_cuda_serves(monkeypatch):
    """A GPU as the cuda backend would see one: no probe, compute capability 9.0."""
    monkeypatch.setattr(CudaBackend, "_probe", lambda self: (False, None))
    monkeypatch.setattr(cuda_backend, "_gpu_compute_capability", lambda x: (9, 0))


@pytest.mark.parametrize("d,dv", [(512, 512), (576, 512)])
def test_head_dims_past_the_cuda_kernels_go_to_the_torch_path(rng, op, monkeypatch, d, dv):
    _gpu_that_cuda_serves(monkeypatch)
    call = _on_gpu(validate_forward(*_tensors(rng, d, dv), causal=True))
    assert op.select(call).name == "cuda"                  # sm_90: the SIMT kernels' wide buckets
    monkeypatch.setattr(cuda_backend, "_gpu_compute_capability", lambda x: (7, 5))
    why = " ".join(CudaBackend().not_supported_reasons(call))
    assert f"head dim {d} > 256" in why and "compute capability >= 8.0" in why   # a T4 has 48 KiB a block
    assert op.select(call).name == "rocm"
    text = op._explanation(call)
    assert text.chosen == "rocm"
    assert "serves as the last resort" in text and "rocm runs it on cuda" in text
    line = next(c for c in text.candidates if c.name == "rocm")
    assert line.chosen and line.reasons    # its ordinary reason (no HIP device) is still shown


def test_a_576_backward_stays_on_the_cuda_kernels(rng, op, monkeypatch):
    _gpu_that_cuda_serves(monkeypatch)
    out, lse = torch.zeros((1, 7, 2, 512)), torch.zeros((1, 2, 7))
    for d in (576, 300):   # buckets 576 (MLA's 576 / 512) and 512
        q, k, v = _tensors(rng, d, 512)
        backward = _on_gpu(validate_backward(torch.ones_like(out), q, k, v, out, lse, causal=True))
        assert CudaBackend().not_supported_reasons(backward) == []
        assert op.select(backward).name == "cuda"


def test_a_bias_gradient_takes_the_cuda_kernels_for_every_broadcast_and_with_mods(rng, op, monkeypatch):
    """The cuda kernels sum dbias for a bias broadcast any way, with dropout too, and together with user mods
    (score_mod_grad's factor kept apart from softcap's): on an NVIDIA GPU none of these falls to the torch path."""
    _gpu_that_cuda_serves(monkeypatch)
    q, k, v = _tensors(rng)
    out = torch.zeros_like(q)
    lse = torch.zeros((1, 2, 7))
    for shape in [(2, 7, 9), (1, 9), (7, 1), (7, 9)]:
        bias = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
        backward = _on_gpu(validate_backward(torch.ones_like(q), q, k, v, out, lse, attn_bias=bias,
                                             return_dbias=True, dropout_p=0.1, dropout_seed=3))
        assert op.select(backward).name == "cuda", shape
        backward = _on_gpu(validate_backward(torch.ones_like(q), q, k, v, out, lse, attn_bias=bias,
                                             return_dbias=True, score_mod=_doubled, score_mod_grad=_two))
        assert CudaBackend().not_supported_reasons(backward) == [], shape
        assert op.select(backward).name == "cuda", shape


def _doubled(score, b, h, q_idx, kv_idx):
    return 2.0 * score


def _two(score, b, h, q_idx, kv_idx):
    return 2.0


def test_what_the_cuda_kernels_serve_stays_on_them(rng, op, monkeypatch):
    _gpu_that_cuda_serves(monkeypatch)
    call = _on_gpu(validate_forward(*_tensors(rng, 128), causal=True))
    assert op.select(call).name == "cuda"
    assert "last resort" not in op._explanation(call)


def test_a_cuda_backend_that_declines_while_running_hands_over_to_the_torch_path(rng, op, monkeypatch):
    # e.g. every tile config of a kernel failed its first-use self-check on this GPU
    _gpu_that_cuda_serves(monkeypatch)

    def decline(self, call):
        raise BackendDeclined(["self-check failed for every tile config"])

    ran = []
    monkeypatch.setattr(CudaBackend, "forward", decline)
    monkeypatch.setattr(RocmBackend, "forward", lambda self, call: ran.append(call.device) or ("torch path", None))
    call = _on_gpu(validate_forward(*_tensors(rng), causal=True))
    assert op._run(call, None, "forward") == ("torch path", None)
    assert ran == ["cuda"]


def test_host_arrays_and_cpu_tensors_get_no_last_resort(rng, op, monkeypatch):
    # A call the cpu kernels decline is the torch path's alone: unforced, a CPU call still gets NoBackendError
    # naming the backend that would serve it, not a silent switch. (The cpu backend serves every feature today;
    # one that declines stands in.)
    from backends.cpu import CpuBackend

    monkeypatch.setattr(CpuBackend, "feature_reasons", lambda self, call: ["a feature of the test's not supported"])
    q, k, v = _tensors(rng)
    bias = torch.from_numpy(rng.standard_normal((2, 7, 9)).astype(np.float32))
    for kind in ("torch", "numpy"):
        args = [q, k, v] if kind == "torch" else [x.numpy() for x in (q, k, v)]
        b = bias if kind == "torch" else bias.numpy()
        call = validate_backward(args[0] * 0 + 1, *args, args[0] * 0, np.zeros((1, 2, 7), np.float32)
                                 if kind == "numpy" else torch.zeros((1, 2, 7)), attn_bias=b, return_dbias=True)
        assert RocmBackend().last_resort_reasons(call) is None
        with pytest.raises(NoBackendError, match="rocm"):
            op.select(call)


def test_meta_tensors_get_no_last_resort(op):
    # No data to attend over: a clear NoBackendError, not an error from deep inside torch.
    q = torch.empty((1, 5, 2, 8), device="meta")
    with pytest.raises(NoBackendError, match="meta tensors not supported"):
        op.forward(q, q, q)


def test_a_gpu_call_nobody_can_serve_still_says_why(rng, op, monkeypatch):
    _gpu_that_cuda_serves(monkeypatch)
    call = _on_gpu(validate_forward(*_tensors(rng)))
    call = replace(call, dtype="float64")   # no GPU backend takes float64 from torch... but the torch path does
    assert op.select(call).name == "rocm"
    bad = replace(call, dtype="int8")        # nothing does
    with pytest.raises(NoBackendError) as info:
        op.select(bad)
    assert "rocm" in str(info.value) and "cuda" in str(info.value)
