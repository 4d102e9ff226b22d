"""Every tiled kernel's spec, by name: the one list a new kernel joins (its file declares ``SPEC`` beside its
factory; an entry here registers it). The kernel modules import ``numba.cuda``, so the host imports this on a
kernel's first launch, not with the package."""

from __future__ import annotations

from numba_flash.cuda.kernels import backward_dkdv, backward_dq, forward, tc_dkdv, tc_dq, tc_forward, tf32_forward
from numba_flash.cuda.kernels.spec import KernelSpec

REGISTRY: dict[str, KernelSpec] = {spec.name: spec for spec in (
    forward.SPEC, tc_forward.SPEC, tf32_forward.SPEC,
    backward_dkdv.SPEC, tc_dkdv.SPEC,
    backward_dq.SPEC, tc_dq.SPEC,
)}


def kernel_spec(name: str) -> KernelSpec:
    """The spec of the tiled kernel called ``name`` (a tile config's ``kernel``)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"kernel: expected one of {sorted(REGISTRY)}, got {name!r}") from None
