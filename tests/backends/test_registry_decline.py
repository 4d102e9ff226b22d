"""The dispatcher when a backend declines a call while running it (``BackendDeclined``, what the CUDA backend
raises when no config of a kernel passes its first-use self-check), and backend notes in ``explain()``.

The backends here are fakes that answer with their own name, so a test sees which backend ran."""

import numpy as np
import pytest

from backends import backend_registry
from backends.base import Backend
from numba_flash import NoBackendError
from numba_flash.errors import BackendDeclined

OP = "flash_decline_test"
REASON = "self-check failed for forward 8x8/16 D=16 float32 causal: out: max abs error 0.31 > 1e-05"


class _Fake(Backend):
    SUPPORTED_KINDS = ("numpy",)
    SUPPORTED_DTYPES = ("float32",)
    OPS = (OP,)

    def forward(self, call):
        return self.name, None

    def backward(self, call):
        return self.name, self.name, self.name


class Checking(_Fake):
    """Finds out on its first run that it cannot serve the call, and says so from then on (as the CUDA backend)."""

    PRIORITY = 60
    remembers = True

    def __init__(self):
        self.failed = False
        self.runs = 0

    def not_supported_reasons(self, call, forced=False):
        return super().not_supported_reasons(call, forced) + ([REASON] if self.failed and self.remembers else [])

    def forward(self, call):
        self.runs += 1
        self.failed = True
        raise BackendDeclined([REASON])

    backward = forward


class Forgetful(Checking):
    """Declines every run but never reports it up front: the dispatcher must still not loop."""

    remembers = False


class Noting(_Fake):
    PRIORITY = 40

    def notes(self, call):
        return ["using 8x8/32 instead"]


class Plain(_Fake):
    PRIORITY = 10


@pytest.fixture
def op(monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)
    names = []

    def setup(**backends):
        for name, be in backends.items():
            backend_registry.register(OP, name, be, replace=True)
            names.append(name)
        return backend_registry.get(OP)

    yield setup
    for name in names:
        backend_registry.unregister(OP, name)


def _qkv(rng):
    return [rng.standard_normal((1, 7, 2, 5)).astype(np.float32) for _ in range(3)]


@pytest.mark.parametrize("cls", [Checking, Forgetful])
def test_declined_call_goes_to_the_next_backend(rng, op, cls):
    checking = cls()
    dispatcher = op(checking=checking, plain=Plain())
    q, k, v = _qkv(rng)
    assert dispatcher.forward(q, k, v, causal=True) == "plain"
    assert checking.runs == 1
    dout = rng.standard_normal(q.shape).astype(np.float32)
    lse = np.zeros((1, 2, 7), np.float32)
    assert dispatcher.backward(dout, q, k, v, q, lse, causal=True) == ("plain",) * 3
    if cls is Checking:
        assert checking.runs == 1                    # it said no up front, so it was not asked again
        assert REASON in dispatcher.explain(q, k, v, causal=True)
    else:
        assert checking.runs == 2                    # asked once per call, never twice in one call


@pytest.mark.parametrize("cls", [Checking, Forgetful])
def test_declined_forced_backend_raises_with_its_reasons(rng, op, cls):
    checking = cls()
    op(checking=checking, plain=Plain())
    q, k, v = _qkv(rng)
    with pytest.raises(NoBackendError) as info:
        backend_registry.get(OP, backend="checking").forward(q, k, v, causal=True)
    assert info.value.reasons == {"checking": [REASON]}
    assert f"checking: {REASON}" in str(info.value)
    assert checking.runs == 1


def test_every_backend_declining_raises(rng, op):
    first, second = Checking(), Forgetful()
    second.PRIORITY = 50
    dispatcher = op(first=first, second=second)
    with pytest.raises(NoBackendError, match="no backend can serve") as info:
        dispatcher.forward(*_qkv(rng))
    assert info.value.reasons == {"first": [REASON], "second": [REASON]}
    assert first.runs == second.runs == 1


def test_explain_shows_notes_of_a_backend_that_can_serve(rng, op):
    dispatcher = op(noting=Noting(), plain=Plain())
    text = dispatcher.explain(*_qkv(rng))
    assert "noting [priority 40]: can serve (using 8x8/32 instead)  <- chosen" in text
    assert "plain [priority 10]: can serve" in text and "plain [priority 10]: can serve (" not in text
