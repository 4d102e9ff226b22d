"""Which forward kernel a float16/bfloat16 call gets on Hopper (plan.forward_kernel, plan.wgmma_reason): the wgmma
kernel only where ``tile_config_override(wgmma=True)`` asks for it, and a clear refusal where it cannot serve."""

from __future__ import annotations

import pytest

from numba_flash import AttentionInputError
from numba_flash.cuda.host.picker import TileOverride
from numba_flash.cuda.host.plan import forward_kernel, wgmma_reason

ASK = TileOverride(wgmma=True)


@pytest.mark.parametrize("dtype,d", [("float16", 64), ("bfloat16", 128), ("float16", 40), ("bfloat16", 97)])
def test_asked_for_on_9_0_it_serves(dtype, d):
    assert forward_kernel(dtype, d, ASK, cc=(9, 0)) == "wgmma_forward"
    assert wgmma_reason(dtype, d, ASK, cc=(9, 0)) is None


def test_not_asked_for_it_never_serves():
    assert forward_kernel("float16", 64, None, cc=(9, 0)) == "tc_forward"
    assert "tile_config_override(wgmma=True)" in wgmma_reason("float16", 64, None, cc=(9, 0))
    assert forward_kernel("float16", 64, TileOverride(wgmma=False), cc=(9, 0)) == "tc_forward"


@pytest.mark.parametrize("why,args,kw", [
    ("compute capability 9.0 only", ("float16", 64), dict(cc=(8, 0))),
    ("compute capability 9.0 only", ("float16", 64), dict(cc=(10, 0))),
    ("head dims 33 to 128", ("float16", 256), dict(cc=(9, 0))),
    ("head dims 33 to 128", ("bfloat16", 32), dict(cc=(9, 0))),
    ("head dims 33 to 128", ("float16", 64), dict(cc=(9, 0), head_dim_v=200)),
    ("staged values do not fit", ("float16", 128), dict(cc=(9, 0), staged_mods=True)),
])
def test_asked_for_where_it_cannot_serve_raises_naming_why(why, args, kw):
    with pytest.raises(AttentionInputError, match=f"wgmma=True: .*{why}"):
        wgmma_reason(*args, ASK, **kw)


def test_mods_at_d64_fit_and_a_float32_call_stays_off_tensor_cores():
    assert wgmma_reason("float16", 64, ASK, cc=(9, 0), staged_mods=True) is None
    assert forward_kernel("float32", 64, ASK, cc=(9, 0)) == "forward"


def test_the_override_takes_only_a_bool():
    from numba_flash.cuda import tile_config_override

    with pytest.raises(AttentionInputError, match="wgmma: expected True, False or None, got 1"):
        with tile_config_override(wgmma=1):
            pass
