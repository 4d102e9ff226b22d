"""Several GPUs: the CUDA backend launches on the GPU that holds the inputs, not numba's current device, and
refuses inputs spread over two GPUs.

There is no GPU here, let alone two, so the GPU side is faked, in the normal process:
- the arrays are numpy-backed objects exporting ``__cuda_array_interface__`` with made-up data pointers, and the
  driver's pointer-to-device query (``backends.cuda_io._pointer_device``) answers from a table of those pointers;
- ``numba.cuda.gpus`` is a fake whose ``gpus[i]`` context manager records which device is current;
  ``numba.cuda.as_cuda_array`` and ``numba.cuda.device_array`` are fakes that record the device current when
  they are called (device_array allocates a numpy-backed fake on it);
- ``flash.flash_forward`` / ``flash_backward`` are replaced by recorders that note the current device and the
  devices of the arrays they got, and write the float64 reference's results into the outputs.
The torch and CuPy kinds are recognised by their module name, so their fakes are classes named into a ``torch`` /
``cupy`` module; they only carry a device. What is real: ``backends.cuda`` (``Session``, ``CudaBackend.forward``
and ``backward``, ``device_index``) and validation.
"""

import contextlib
import itertools
import types

import numpy as np
import pytest

import backends.cuda_io as cuda_io
from backends.cuda import CudaBackend
from backends.cuda_io import device_index, Session
from numba_flash import AttentionInputError, attention_ref, attention_ref_backward
from numba_flash.validation import validate_backward, validate_forward

_pointers = {}                     # fake data pointer -> device index
_next_pointer = itertools.count(0x7F0000000000, 0x100000)


class FakeGpuArray:
    """A numpy array that claims to live on GPU ``device``."""

    def __init__(self, arr, device):
        self.arr = np.asarray(arr)
        self.ptr = next(_next_pointer)
        _pointers[self.ptr] = device

    @property
    def shape(self):
        return self.arr.shape

    @property
    def dtype(self):
        return self.arr.dtype

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.arr.shape, "typestr": self.arr.dtype.str, "data": (self.ptr, False), "version": 3,
                "strides": None}


def _on(device):
    return _pointers[device.ptr] if isinstance(device, FakeGpuArray) else None


class FakeGpus:
    """``numba.cuda.gpus``: ``with gpus[i]:`` makes i current; ``current`` is the device now current."""

    def __init__(self, current=0):
        self.stack = [current]
        self.entered = []

    @property
    def current(self):
        return self.stack[-1]

    def __getitem__(self, index):
        @contextlib.contextmanager
        def enter():
            self.entered.append(index)
            self.stack.append(index)
            try:
                yield
            finally:
                self.stack.pop()
        return enter()


@pytest.fixture
def gpus(monkeypatch):
    """Two fake GPUs, numba's current one being 0; returns the fake device list and the recorder's log."""
    from numba import cuda

    from numba_flash.cuda.host import flash

    fake = FakeGpus(current=0)
    fake.log = []
    monkeypatch.setattr(cuda_io, "_pointer_device", lambda ptr: _pointers[ptr])
    monkeypatch.setattr(cuda, "gpus", fake)

    def as_cuda_array(x, sync=True):
        fake.log.append(("wrap", fake.current))
        return x

    def device_array(shape, dtype, stream=0):
        fake.log.append(("alloc", fake.current))
        return FakeGpuArray(np.full(shape, np.nan, dtype), fake.current)

    def flash_forward(q, k, v, out, lse, **kw):
        fake.log.append(("forward", fake.current, [_on(x) for x in (q, k, v, out, lse)]))
        ref, ref_lse = attention_ref(q.arr, k.arr, v.arr, softmax_scale=kw["softmax_scale"],
                                     window_size=(kw["window_left"], kw["window_right"]))
        out.arr[...] = ref
        lse.arr[...] = ref_lse

    def flash_backward(dout, q, k, v, out, lse, dq, dk, dv, delta, **kw):
        fake.log.append(("backward", fake.current, [_on(x) for x in (dout, q, k, v, out, lse, dq, dk, dv, delta)]))
        grads = attention_ref_backward(dout.arr, q.arr, k.arr, v.arr, softmax_scale=kw["softmax_scale"],
                                       window_size=(kw["window_left"], kw["window_right"]))
        for got, want in zip((dq, dk, dv), grads):
            got.arr[...] = want

    monkeypatch.setattr(cuda, "as_cuda_array", as_cuda_array)
    monkeypatch.setattr(cuda, "device_array", device_array)
    monkeypatch.setattr(flash, "flash_forward", flash_forward)
    monkeypatch.setattr(flash, "flash_backward", flash_backward)
    return fake


def _inputs(rng, devices=(1, 1, 1), sq=7, sk=9, d=5):
    shapes = ((1, sq, 2, d), (1, sk, 1, d), (1, sk, 1, d))
    return [FakeGpuArray(rng.standard_normal(s).astype(np.float32), dev) for s, dev in zip(shapes, devices)]


def test_device_index_of_every_kind(monkeypatch):
    monkeypatch.setattr(cuda_io, "_pointer_device", lambda ptr: _pointers[ptr])
    torch_like = type("Tensor", (), {"__module__": "torch.fake_for_test"})()
    # The backend knows tensors by type (isinstance torch.Tensor); a real one cannot claim a GPU here.
    monkeypatch.setattr(cuda_io, "_is_torch", lambda x: x is torch_like)
    torch_like.device = types.SimpleNamespace(type="cuda", index=1)
    cupy_like = type("ndarray", (), {"__module__": "cupy.fake_for_test"})()
    cupy_like.device = types.SimpleNamespace(id=1)
    dlpack_gpu = types.SimpleNamespace(__dlpack_device__=lambda: (2, 1))
    dlpack_host = types.SimpleNamespace(__dlpack_device__=lambda: (1, 0))
    null = types.SimpleNamespace(__cuda_array_interface__={"data": (0, False)})
    assert device_index(torch_like) == 1
    assert device_index(cupy_like) == 1
    assert device_index(FakeGpuArray(np.zeros(3), 1)) == 1
    assert device_index(FakeGpuArray(np.zeros(3), 0)) == 0
    assert device_index(dlpack_gpu) == 1
    assert device_index(dlpack_host) is None
    assert device_index(null) is None                     # an empty array has no pointer to ask about
    assert device_index(np.zeros(3)) is None
    torch_like.device = types.SimpleNamespace(type="cpu", index=None)
    assert device_index(torch_like) is None


def test_forward_runs_on_the_gpu_of_its_inputs(rng, gpus):
    q, k, v = _inputs(rng, (1, 1, 1))
    call = validate_forward(q, k, v, causal=True)
    out, lse = CudaBackend().forward(call)
    kind, current, devices = gpus.log[-1]
    assert kind == "forward" and current == 1             # launched with GPU 1 current, while numba's was 0
    assert devices == [1, 1, 1, 1, 1]                       # and out and lse were allocated there
    assert gpus.entered == [1] and gpus.current == 0        # the caller's current device is restored
    assert all(entry[1] == 1 for entry in gpus.log)         # every wrap and allocation happened on GPU 1 too
    ref, ref_lse = attention_ref(q.arr, k.arr, v.arr, causal=True)
    assert isinstance(out, FakeGpuArray) and np.max(np.abs(out.arr - ref)) <= 1e-6
    np.testing.assert_allclose(lse.arr, ref_lse, rtol=1e-6)


def test_backward_runs_on_the_gpu_of_its_inputs(rng, gpus):
    q, k, v = _inputs(rng, (1, 1, 1))
    dout, out = (FakeGpuArray(rng.standard_normal(q.shape).astype(np.float32), 1) for _ in range(2))
    lse = FakeGpuArray(rng.standard_normal((1, 2, 7)).astype(np.float32), 1)
    grads = CudaBackend().backward(validate_backward(dout, q, k, v, out, lse))
    kind, current, devices = gpus.log[-1]
    assert kind == "backward" and current == 1 and devices == [1] * 10
    assert gpus.entered == [1] and gpus.current == 0
    for got, want in zip(grads, attention_ref_backward(dout.arr, q.arr, k.arr, v.arr)):
        assert got.shape == want.shape and np.max(np.abs(got.arr - want)) <= 1e-5


def test_each_gpu_gets_its_own_calls(rng, gpus):
    for device in (0, 1, 0):
        CudaBackend().forward(validate_forward(*_inputs(rng, (device,) * 3)))
        assert gpus.log[-1][1] == device
    assert gpus.entered == [0, 1, 0]


@pytest.mark.parametrize("devices,bad", [((1, 0, 1), "k"), ((0, 0, 1), "v"), ((0, 1, 1), "k")])
def test_forward_inputs_on_two_gpus_are_refused(rng, gpus, devices, bad):
    call = validate_forward(*_inputs(rng, devices))
    with pytest.raises(AttentionInputError) as info:
        CudaBackend().forward(call)
    want = devices[["q", "k", "v"].index(bad)]
    assert str(info.value) == f"{bad}: expected an array on the GPU of q (cuda:{devices[0]}), got one on cuda:{want}"
    assert gpus.log == [] and gpus.entered == []            # refused before any allocation or launch


@pytest.mark.parametrize("bad", ["dout", "out", "lse"])
def test_backward_inputs_on_two_gpus_are_refused(rng, gpus, bad):
    q, k, v = _inputs(rng, (1, 1, 1))
    extra = {"dout": (q.shape, 1), "out": (q.shape, 1), "lse": ((1, 2, 7), 1)}
    extra[bad] = (extra[bad][0], 0)
    dout, out, lse = (FakeGpuArray(rng.standard_normal(s).astype(np.float32), dev) for s, dev in extra.values())
    with pytest.raises(AttentionInputError, match=rf"^{bad}: expected an array on the GPU of q \(cuda:1\), "
                                                  r"got one on cuda:0$"):
        CudaBackend().backward(validate_backward(dout, q, k, v, out, lse))
    assert gpus.log == []


def test_host_inputs_enter_no_gpu(rng, gpus):
    # numpy (and, under the simulator, CPU tensors) are copied to numba's current device: nothing to switch to.
    q, k, v = (x.arr for x in _inputs(rng))
    io = Session(validate_forward(q, k, v))
    assert io.index is None
    with io.on_device():
        pass
    assert gpus.entered == []
