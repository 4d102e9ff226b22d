"""The thin launch path packs each kernel's arguments as numba-cuda does (numba_flash/cuda/host/abi.py): held to
the ``.entry`` parameter list of the PTX the real compiler makes, for every registered tiled kernel and the
untiled ones (the backward's delta pre-pass, decoding's kernel and its merge).

The fast test compiles an empty body with each kernel's launch signature (the parameter list depends on the
signature alone: numba keeps every parameter, used or not); the slow one compiles the kernels themselves (about
10 s each on one core): SPOT_CHECK of them, drawn afresh each run (NUMBA_FLASH_SPOT_CHECK_SEED repeats a draw),
or all with NUMBA_FLASH_THIN_PTX_ALL=1.
Run: .venv/bin/python -m pytest -q -m ptx tests/numba_flash/cuda/test_thin_abi_ptx.py"""

import os
import random

import pytest

pytestmark = pytest.mark.ptx

UNTILED = ("backward_delta", "decode", "decode_merge", "dbias_sum")
#: Kernels whose real PTX the slow test compiles on each run (all with NUMBA_FLASH_THIN_PTX_ALL=1).
SPOT_CHECK = 3


def _toolchain():
    pytest.importorskip("numba.cuda")
    pytest.importorskip("cuda.bindings.nvjitlink")


def _kernels():
    """(kernel name as compile_check names it, dtype) for every registered kernel and dtype, and the untiled ones."""
    from numba_flash.cuda.kernels.registry import REGISTRY

    cases = [(name, dtype) for name, spec in REGISTRY.items() for dtype in spec.dtypes]
    return cases + [(name, dtype) for name in UNTILED for dtype in ("float32", "float16", "bfloat16")
                    if name != "dbias_sum" or dtype == "float32"]


def _empty_kernel_ptx(signature):
    """PTX of a kernel with ``signature`` and nothing in its body (numba keeps every parameter)."""
    from numba import cuda

    nargs = len(signature.args)
    names = ", ".join(f"a{i}" for i in range(nargs))
    scope: dict = {}
    exec(f"def empty({names}):\n    pass\n", scope)
    ptx, _ = cuda.compile_ptx(scope["empty"], signature, cc=(8, 0))
    return ptx


def test_registered_kernels_are_all_covered():
    from numba_flash.cuda.kernels.registry import REGISTRY

    assert {name for name, _ in _kernels()} >= set(REGISTRY)


@pytest.mark.parametrize("kernel,dtype", _kernels())
def test_packed_slots_match_ptx_params_of_the_launch_signature(kernel, dtype):
    _toolchain()
    from numba_flash.cuda.compile_check import kernel_signature
    from numba_flash.cuda.host.abi import ArgBuffer, ptx_entry_params, ptx_mismatches, slots_of

    signature = kernel_signature(kernel, dtype)
    slots = slots_of(signature.args)
    params = ptx_entry_params(_empty_kernel_ptx(signature))
    assert ptx_mismatches(slots, params) == []
    buffer = ArgBuffer(slots)
    assert all(off % slot.size == 0 for off, slot in zip(buffer.offsets, slots))   # natural alignment
    assert len(buffer.offsets) == len(params)


def _representative(kernel, dtype):
    """A production tile config of ``kernel`` at head dim 64 for sm_80 (None for the untiled kernels)."""
    from numba_flash.cuda.host.picker import TileOverride, tile_config_for

    if kernel in ("backward_delta", "decode_merge", "dbias_sum"):
        return None
    return tile_config_for(64, dtype, (8, 0), kernel=kernel, override=TileOverride())


def _spot_checked() -> set:
    names = sorted({k for k, _ in _kernels()})
    if os.environ.get("NUMBA_FLASH_THIN_PTX_ALL") == "1":
        return set(names)
    seed = int(os.environ.get("NUMBA_FLASH_SPOT_CHECK_SEED", random.SystemRandom().randrange(2**32)))
    print(f"thin-launch PTX spot check seed={seed}")
    return set(random.Random(seed).sample(names, SPOT_CHECK))


_SPOT: set = set()


@pytest.mark.slow
@pytest.mark.parametrize("kernel", sorted({k for k, _ in _kernels()}))
def test_packed_slots_match_each_compiled_kernels_ptx(kernel):
    _toolchain()
    if not _SPOT:
        _SPOT.update(_spot_checked())
    if kernel not in _SPOT:
        pytest.skip("not drawn for this run's spot check (NUMBA_FLASH_THIN_PTX_ALL=1 compiles every kernel)")
    from numba_flash.cuda.compile_check import kernel_ptx, kernel_signature
    from numba_flash.cuda.host.abi import ptx_entry_params, ptx_mismatches, slots_of
    from numba_flash.cuda.kernels.registry import REGISTRY

    dtype = REGISTRY[kernel].dtypes[0] if kernel in REGISTRY else "float16"
    if kernel == "dbias_sum":
        dtype = "float32"
    ptx = kernel_ptx(kernel, _representative(kernel, dtype), dtype, (8, 0))
    assert ptx_mismatches(slots_of(kernel_signature(kernel, dtype).args), ptx_entry_params(ptx)) == []
