"""When a torch face may run its custom op's implementation directly, skipping torch's op dispatcher.

The faces' custom ops (``numba_flash::flash_fwd``, ``flash_bwd``, ``flash_kvcache``) are what ``torch.compile``,
torch dispatch modes and functorch transforms see; in a plain eager call none of them is there, and the dispatch
alone costs more than a tiny call's work on the CPU (about 170 us of a 400 us decode step through ``flash_kvcache``:
``fill_defaults`` and the autograd and ADInplaceOrView layers). An eager call that needs no autograd graph runs the
implementation directly instead, and does by hand the one thing the dispatcher would have done for it: bump the
version counters of the tensors the op declares it mutates (``mutates_args``), so that autograd still notices a
KV cache written in place.

Imports torch at import time; the torch faces import it.
"""

from typing import Optional

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode


def runs_eagerly(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a call on ``tensors`` (None entries ignored) may skip the custom ops' dispatcher and run their
    implementation directly: not traced by torch.compile, no torch dispatch mode active (FakeTensorMode,
    FlopCounterMode...: they must see the op), no functorch transform (vmap, grad) active, and plain tensors (a
    subclass may dispatch on the op)."""
    return (not torch.compiler.is_compiling() and not is_in_torch_dispatch_mode()
            and not torch._C._are_functorch_transforms_active()
            and all(t is None or type(t) is torch.Tensor for t in tensors))


def any_requires_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether one of ``tensors`` (None entries ignored) requires grad, grad mode on or off."""
    return any(t is not None and t.requires_grad for t in tensors)


def bump_versions(*tensors: torch.Tensor) -> None:
    """Bump the autograd version counters of ``tensors`` as the ADInplaceOrView kernel of an op declaring them in
    ``mutates_args`` does (``torch.autograd.graph.increment_version``; inference tensors have none and are left)."""
    torch.autograd.graph.increment_version(tensors)


__all__ = ["runs_eagerly", "any_requires_grad", "bump_versions"]
