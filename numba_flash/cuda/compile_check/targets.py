"""The targets the compile check assembles a kernel for: a GPU's compute capability (major, minor), or, for the
kernels whose instructions exist only on the architecture-specific target of one GPU, that target as a 3-tuple
(major, minor, "a"), spelt as numba-cuda and nvJitLink take it (``sm_90a``: device/hopper.ARCH).

wgmma and setmaxnreg assemble for sm_90a and nowhere else: plain sm_90 rejects them, and sm_90a code runs only on
a 9.0 GPU. So a wgmma kernel's rows carry (9, 0, "a"), and a compile check of compute capability 9.0 covers them
beside the sm_90 rows of the other kernels (an H100 runs both).
"""

from __future__ import annotations

import re

from numba_flash.cuda.host.config import TC_MIN_COMPUTE_CAPABILITY
from numba_flash.cuda.kernels.spec import KernelSpec

#: Kernel kinds (spec.KINDS) that assemble only for the "a" target of their spec's ``min_compute_capability``.
ARCH_SPECIFIC_KINDS = frozenset({"wgmma"})
#: The suffix of an architecture-specific target.
ARCH_SPECIFIC = "a"

#: A compute capability (major, minor), or an architecture-specific target (major, minor, "a").
Target = tuple


def kernel_target(spec: KernelSpec, cc: Target) -> Target | None:
    """The target ``spec``'s kernel is assembled for when the compile check covers ``cc`` (a compute capability,
    or an "a" target, which selects the architecture-specific kernels alone); None where the kernel does not run
    there."""
    cc = tuple(cc)
    if spec.kind in ARCH_SPECIFIC_KINDS:
        return (*spec.min_compute_capability, ARCH_SPECIFIC) if cc[:2] == spec.min_compute_capability else None
    if len(cc) > 2 or cc < spec.min_compute_capability:
        return None
    if spec.tensor_cores and cc < TC_MIN_COMPUTE_CAPABILITY:
        return None
    return cc


def target_name(cc: Target) -> str:
    """``sm_90``, ``sm_90a``: the target as nvJitLink's ``-arch`` names it."""
    return "sm_" + "".join(str(part) for part in cc)


def target_label(cc: Target) -> str:
    """``9.0``, ``9.0a``: the target as the compile check's ``--cc`` takes it and its table prints it."""
    return f"{cc[0]}.{cc[1]}" + "".join(str(part) for part in cc[2:])


def parse_target(text: str) -> Target:
    """The target ``text`` names ("8.0", "9.0a"; ``target_label``'s inverse); ValueError for anything else."""
    found = re.fullmatch(rf"(\d+)\.(\d+)({ARCH_SPECIFIC})?", text.strip())
    if not found:
        raise ValueError(f"expected a compute capability like 8.0 or an architecture-specific target like 9.0a, "
                         f"got {text!r}")
    major, minor, suffix = found.groups()
    return (int(major), int(minor)) + ((suffix,) if suffix else ())
