"""The CPU kernels' variant for mods (numba_flash.cpu.modhooks): compiled once per dtype for any mods and kept in
numba's disk cache, so a mod the process has not seen compiles only its small hooks; and a mod that raises inside
the kernel, where numba's first-class function calls drop exceptions, is still named with its own exception."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from numba_flash import AttentionInputError, attention_ref, attention_ref_backward, backend_registry, compile_notice
from numba_flash.warmup import MODS as WARMUP_MODS, MODS_GRAD as WARMUP_MODS_GRAD


def _inputs(rng):
    q = rng.standard_normal((2, 93, 2, 24)).astype(np.float32)
    k, v = (rng.standard_normal((2, 150, 1, 24)).astype(np.float32) for _ in range(2))
    return q, k, v, rng.standard_normal(q.shape).astype(np.float32)


def test_a_new_mod_compiles_its_hooks_and_no_kernel(rng):
    """float32, as every CPU test of mods: the float64 variant is the same source for another dtype, and would cost
    CI 3-4 minutes of compile (``make test``'s warmup makes the float32 one)."""
    q, k, v, dout = _inputs(rng)
    op = backend_registry.get("flash", backend="cpu")
    out, lse = op.forward(q, k, v, return_lse=True, **WARMUP_MODS)   # the kernels' mods variant ready
    op.backward(dout, q, k, v, out, lse, **WARMUP_MODS, **WARMUP_MODS_GRAD)
    # functions this process has never seen, with a width and weights drawn now
    width = int(rng.integers(20, 60))
    weights = rng.uniform(-0.2, 0.2, size=7)

    def banded(b, h, q_idx, kv_idx):
        return abs(q_idx + 57 - kv_idx) < width

    def periodic(b, h, q_idx, kv_idx):
        return weights[(q_idx * 3 + kv_idx + h) % 7] + 0.1 * b

    def cubed(score, b, h, q_idx, kv_idx):
        return score - score ** 3 / 30.0

    def cubed_grad(score, b, h, q_idx, kv_idx):
        return 1.0 - score ** 2 / 10.0

    kw = dict(mask_mod=banded, bias_mod=periodic, score_mod=cubed)
    before = len(compile_notice.compiled())
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    grads = op.backward(dout, q, k, v, out, lse, score_mod_grad=cubed_grad, **kw)
    names = [name for name, _ in compile_notice.compiled()[before:]]
    assert any(name.endswith("[mods]") for name in names), names   # the hooks were compiled for these mods ...
    assert not [n for n in names if n.endswith(("_kernel", "_worker"))], names   # ... and no kernel
    np.testing.assert_allclose(out, attention_ref(q, k, v, **kw)[0], atol=2e-5, rtol=0)
    for got, want in zip(grads, attention_ref_backward(dout, q, k, v, score_mod_grad=cubed_grad, **kw)):
        assert np.linalg.norm(got - want) <= 2e-5 * np.linalg.norm(want)


_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from numba_flash import attention_ref, backend_registry
    from numba_flash.cpu import backward, forward

    rng = np.random.default_rng(int(sys.argv[1]))
    q = rng.standard_normal((1, 70, 2, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 81, 2, 16)).astype(np.float32) for _ in range(2))
    reach = int(rng.integers(5, 40))

    def near(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + reach

    out = backend_registry.get("flash", backend="cpu").forward(q, k, v, mask_mod=near)
    kernel = forward.forward_kernel
    with_hooks = [sig for sig in kernel.signatures if str(sig[-1]) != "none"]
    print(json.dumps({"err": float(np.abs(out - attention_ref(q, k, v, mask_mod=near)[0]).max()),
                      "hits": sum(n for sig, n in kernel.stats.cache_hits.items() if str(sig[-1]) != "none"),
                      "misses": sum(n for sig, n in kernel.stats.cache_misses.items() if str(sig[-1]) != "none"),
                      "variants": len(with_hooks)}))
    """
)


def _run(seed: int) -> dict:
    env = dict(os.environ, NUMBA_FLASH_QUIET="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(seed)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "experimental" not in proc.stderr, proc.stderr   # numba warns of first-class functions; not ours to show
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_fresh_process_loads_the_mods_kernel_from_the_disk_cache(rng):
    """A new process with a mod of its own: the forward's mods variant comes from numba's cache (filled by the
    warmup, else by a first process here), one variant for any mods, and numba's warning that first-class functions
    are experimental does not reach the user."""
    first = _run(int(rng.integers(2**32)))
    assert first["err"] <= 2e-5 and first["variants"] == 1, first
    run = first if first["misses"] == 0 else _run(int(rng.integers(2**32)))
    assert run["misses"] == 0 and run["hits"] == 1 and run["err"] <= 2e-5, run


def test_an_exception_in_a_mod_is_named_with_its_tile_and_inputs_stay(rng):
    """numba drops an exception at a first-class function call: the hook reports it, the kernel raises with the
    tile, and the host runs the mods over that tile again to name the exception."""
    q, k, v, _ = _inputs(rng)
    table = rng.standard_normal(140)   # 10 keys short of Sk = 150

    def reads_a_table(b, h, q_idx, kv_idx):
        return table[kv_idx]

    copies = [x.copy() for x in (q, k, v)]
    with pytest.raises(AttentionInputError, match=r"^bias_mod: expected a function that runs on every .* "
                                                  r"bias_mod=reads_a_table raised IndexError: .* \(on queries "
                                                  r"\d+\.\.\d+ x keys 128\.\.149 of b=0 h=\d\)"):
        backend_registry.get("flash", backend="cpu").forward(q, k, v, bias_mod=reads_a_table)
    assert all(np.array_equal(a, b) for a, b in zip((q, k, v), copies))
