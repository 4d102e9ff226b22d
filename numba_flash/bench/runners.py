"""How each backend and peer is called: one ``Runner`` per registry backend (``cpu``, ``cuda``, ``rocm``, plugins)
or peer (``naive``, ``torch``, ``torch_naive``; see ``numba_flash.bench_peers``). The bench and the asv suite both
call attention through these, so they time the same calls."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from .. import bench_peers
from . import memory
from .cases import Case, Inputs, Skip
from .harness import optional_torch
from .memory import fits_in_memory, gib, naive_bytes, numba_cuda_available


def torch_cuda_available() -> bool:
    """Whether torch is installed and sees a GPU."""
    torch = optional_torch()
    return bool(torch is not None and torch.cuda.is_available())


class Runner:
    """Runs one backend or peer on one case. ``prepare`` raises Skip when it cannot. ``device`` is where it runs
    ('cpu' or 'cuda') and ``device_api`` which clock times it ('host', 'torch-cuda', 'numba-cuda')."""

    kind = "backend"

    def __init__(self, name: str):
        self.name = name
        self.device = "cpu"
        self.device_api = "host"

    def prepare(self, case: Case, inputs: Inputs) -> None:
        raise NotImplementedError

    def forward(self) -> Any:
        raise NotImplementedError

    def before_backward(self) -> None:
        """Untimed work the next ``backward`` needs (torch must record a fresh graph)."""

    def backward(self) -> Any:
        raise NotImplementedError

    def release(self) -> None:
        """Drop the arrays kept between calls."""


class BackendRunner(Runner):
    """A registry backend, fed the first array kind it accepts: GPU arrays first (where a GPU exists), then numpy,
    then torch CPU tensors (the only host kind that holds bfloat16)."""

    def prepare(self, case: Case, inputs: Inputs) -> None:
        from numba_flash import backend_registry
        from numba_flash.validation import validate_forward

        be = next((b for b in backend_registry.backends("flash") if b.name == self.name), None)
        if be is None:
            raise Skip("not registered")
        reasons = be.unavailable_reasons(forced=True)
        if reasons:
            raise Skip("; ".join(reasons))
        forms: list[tuple[str, str, Callable[[], dict[str, Any]]]] = []
        if torch_cuda_available():
            forms.append(("cuda", "torch-cuda", lambda: inputs.torch("cuda")))
        if "cuda_array" in be.SUPPORTED_KINDS and numba_cuda_available():
            forms.append(("cuda", "numba-cuda", inputs.numba_cuda))
        forms.append(("cpu", "host", inputs.numpy))
        forms.append(("cpu", "host", lambda: inputs.torch("cpu")))
        why: list[str] = []
        for device, api, make in forms:
            try:
                arrays = make()
            except Skip as exc:
                why.append(str(exc))
                continue
            call = validate_forward(arrays["q"], arrays["k"], arrays["v"], causal=case.causal, layout=case.layout)
            reasons = be.not_supported_reasons(call, forced=True)
            if not reasons:
                self.device, self.device_api, self.arrays = device, api, arrays
                break
            why.extend(r for r in reasons if r not in why)
        else:
            raise Skip("; ".join(why))
        self.op = backend_registry.get("flash", backend=self.name)
        self.kw = {"causal": case.causal, "layout": case.layout, "precision": case.precision}
        self.out, self.lse = None, None

    def forward(self) -> Any:
        a = self.arrays
        out, lse = self.op.forward(a["q"], a["k"], a["v"], return_lse=True, **self.kw)
        self.out, self.lse = out, lse
        return out

    def before_backward(self) -> None:
        if self.out is None:
            self.forward()

    def backward(self) -> Any:
        a = self.arrays
        return self.op.backward(a["dout"], a["q"], a["k"], a["v"], self.out, self.lse, **self.kw)

    def release(self) -> None:
        self.arrays, self.out, self.lse = {}, None, None


class NaiveNumpyRunner(Runner):
    """Textbook attention in numpy with every head's S x S scores in memory (``bench_peers``)."""

    kind = "peer"

    def prepare(self, case: Case, inputs: Inputs) -> None:
        self.arrays = inputs.numpy()
        self.case = case
        needed, available = naive_bytes(case, self.arrays["q"].itemsize), memory.available_host_bytes()
        if not fits_in_memory(needed, available):
            raise Skip(f"the S x S scores need about {gib(needed)}, {gib(available)} available")

    def forward(self) -> Any:
        a = self.arrays
        return bench_peers.naive_forward_numpy(a["q"], a["k"], a["v"], self.case.causal, self.case.layout)

    def backward(self) -> Any:
        a = self.arrays
        return bench_peers.naive_backward_numpy(a["dout"], a["q"], a["k"], a["v"], self.case.causal,
                                                self.case.layout)

    def release(self) -> None:
        self.arrays = {}


class TorchRunner(Runner):
    """torch SDPA (``naive=False``) or textbook torch attention on torch's default device."""

    kind = "peer"

    def __init__(self, name: str, naive: bool):
        super().__init__(name)
        self.naive = naive

    def prepare(self, case: Case, inputs: Inputs) -> None:
        torch = optional_torch()
        if torch is None:
            raise Skip("torch not installed")
        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device_api = "torch-cuda" if self.device == "cuda" else "host"
        if self.device == "cpu" and case.dtype == "bfloat16" and self.naive:
            raise Skip("bfloat16 matmul on CPU is not a meaningful baseline")
        if self.naive:
            needed = naive_bytes(case, torch.finfo(getattr(torch, case.dtype)).bits // 8)
            available = torch.cuda.mem_get_info()[0] if self.device == "cuda" else memory.available_host_bytes()
            if not fits_in_memory(needed, available):
                raise Skip(f"the S x S scores need about {gib(needed)}, {gib(available)} available")
        self.arrays = {n: t.detach().clone() for n, t in inputs.torch(self.device).items()}
        self.case = case
        self.fn = bench_peers.naive_torch if self.naive else bench_peers.sdpa_torch
        self.graph: tuple[Any, tuple[Any, ...]] | None = None

    def forward(self) -> Any:
        a = self.arrays
        with self.torch.no_grad(), _allow_tf32(self.torch, self.case.precision == "tf32"):
            return self.fn(a["q"], a["k"], a["v"], self.case.causal, self.case.layout)

    def before_backward(self) -> None:
        leaves = tuple(self.arrays[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
        with _allow_tf32(self.torch, self.case.precision == "tf32"):
            out = self.fn(*leaves, self.case.causal, self.case.layout)
        self.graph = (out, leaves)

    def backward(self) -> Any:
        out, leaves = self.graph
        self.graph = None
        with _allow_tf32(self.torch, self.case.precision == "tf32"):
            return self.torch.autograd.grad(out, leaves, self.arrays["dout"])

    def release(self) -> None:
        self.arrays, self.graph = {}, None


@contextlib.contextmanager
def _allow_tf32(torch: Any, on: bool) -> Iterator[None]:
    """torch's float32 matmuls (and cuDNN's) allowed TF32 for the block when ``on``, as ``precision="tf32"`` allows
    the backends: the same permission for the peer. Restored after."""
    if not on:
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def make_runner(name: str, kind: str) -> Runner:
    """The runner of backend ``name`` (``kind`` 'backend') or of peer ``name`` (``kind`` 'peer')."""
    if kind == "backend":
        return BackendRunner(name)
    if name == "naive":
        return NaiveNumpyRunner(name)
    return TorchRunner(name, naive=(name == "torch_naive"))
