"""Exceptions raised by numba-flash.

Both live here, away from any kernel or backend, so that user code can catch them without importing torch or
numba.cuda.
"""

from __future__ import annotations

from typing import Any


class AttentionInputError(ValueError):
    """An argument breaks the attention contract.

    The message names the argument, what was expected and what came, e.g.
    ``k: expected 4 dimensions (B, Sk, Hkv, D) for layout 'bshd', got shape (2, 3, 4)``.
    Raised before any work is done; the inputs are never modified.
    """


def bad_arg(arg: str, expected: str, got: Any) -> AttentionInputError:
    """The contract's error for a bad argument: ``"<arg>: expected <expected>, got <got>"`` (raise it)."""
    return AttentionInputError(f"{arg}: expected {expected}, got {got}")


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for quoting a caller's value in an error message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-limit // 4:]} ({len(text)} characters)"


class NoBackendError(RuntimeError):
    """No registered backend can serve a call.

    ``reasons`` maps each backend name to the list of reasons it turned the call down, and the message lists them
    all (``cuda: no CUDA GPU; cpu: bfloat16 not supported``) so that the choice can be debugged from the traceback.
    """

    def __init__(self, op: str, reasons: dict[str, list[str]], forced: str | None = None,
                 if_named: tuple[str, ...] = ()):
        self.op = op
        self.reasons = dict(reasons)
        self.forced = forced
        self.if_named = tuple(if_named)   # backends that would serve the call if it named them
        parts = [f"{name}: {', '.join(why) if why else 'unavailable'}" for name, why in self.reasons.items()]
        head = (
            f"backend {forced!r} cannot serve this {op!r} call"
            if forced
            else f"no backend can serve this {op!r} call"
        )
        tail = "".join(f"; backend={name!r} serves it when named" for name in self.if_named)
        super().__init__(f"{head} ({'; '.join(parts) if parts else 'no backend registered'}){tail}")


class BackendDeclined(RuntimeError):
    """A backend found out while running a call, before writing anything, that it cannot serve it after all (the
    CUDA backend's first-use self-check of a kernel failed on this GPU).

    The dispatcher catches it and picks again as if the backend had given ``reasons`` up front: the next backend
    serves the call, or ``NoBackendError`` lists the reasons when the backend was forced. The backend is expected
    to report the same reasons from ``not_supported_reasons`` from then on.
    """

    def __init__(self, reasons: list[str]):
        self.reasons = list(reasons)
        super().__init__("; ".join(self.reasons))


class UnknownKeywordError(AttentionInputError, TypeError):
    """A keyword argument the function does not take, e.g. ``casual=True``: a TypeError, as Python's own error for
    it is, and an AttentionInputError like every other bad argument. The message names the keyword and the closest
    one the function takes (``casual: not an argument of Dispatcher.forward(); did you mean 'causal'?``)."""
