"""The registry: priority order, forcing (call > get > use() > env var), reasons, entry points, lazy imports."""

import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from backends import backend_registry
from backends.base import Backend
from numba_flash import NoBackendError, attention_ref

OP = "flash_registry_test"


class _Fake(Backend):
    """Answers with its own name in place of an output, so a test sees which backend ran."""

    SUPPORTED_KINDS = ("numpy",)
    SUPPORTED_DTYPES = ("float32",)
    broken = False

    def unavailable_reasons(self, forced=False):
        return ["pretend hardware missing"] if self.broken else []

    def forward(self, call):
        return self.name, None

    def backward(self, call):
        return self.name, self.name, self.name


class Fast(_Fake):
    PRIORITY = 50
    SUPPORTED_DTYPES = ("float16",)
    OPS = (OP,)


class Medium(_Fake):
    PRIORITY = 20
    broken = True
    OPS = (OP,)


class Slow(_Fake):
    PRIORITY = 5
    SUPPORTS_SOFTCAP = False
    OPS = (OP,)


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)
    for name, cls in (("fast", Fast), ("medium", Medium), ("slow", Slow)):
        backend_registry.register(OP, name, cls, replace=True)
    yield backend_registry.get(OP)
    for name in ("fast", "medium", "slow"):
        backend_registry.unregister(OP, name)


def _qkv(rng, dtype=np.float32):
    return [rng.standard_normal((1, 5, 2, 4)).astype(dtype) for _ in range(3)]


def test_first_backend_without_reasons_wins(rng, fakes):
    assert backend_registry.names(OP) == ["fast", "medium", "slow"]
    assert fakes.forward(*_qkv(rng)) == "slow"                      # fast: dtype, medium: unavailable
    assert fakes.forward(*_qkv(rng, np.float16)) == "fast"
    assert backend_registry.available(OP) == ["fast", "slow"]


def test_no_backend_lists_every_reason(rng, fakes):
    with pytest.raises(NoBackendError) as info:
        fakes.forward(*_qkv(rng), softcap=1.0)
    msg = str(info.value)
    assert "fast: float32 not supported" in msg
    assert "medium: pretend hardware missing" in msg
    assert "slow: softcap not supported" in msg
    assert set(info.value.reasons) == {"fast", "medium", "slow"}


def test_forcing_precedence(rng, fakes, monkeypatch):
    q, k, v = _qkv(rng, np.float16)
    slow_ok = dict(backend="slow")
    with pytest.raises(NoBackendError, match=r"backend 'slow' cannot serve .*slow: float16 not supported"):
        fakes.forward(q, k, v, **slow_ok)
    q, k, v = _qkv(rng)
    assert fakes.forward(q, k, v, backend="slow") == "slow"
    monkeypatch.setenv(backend_registry.ENV_VAR, "medium")
    with pytest.raises(NoBackendError, match="medium: pretend hardware missing"):
        fakes.forward(q, k, v)                                       # the env var forces medium
    with backend_registry.use("slow"):
        assert fakes.forward(q, k, v) == "slow"                      # use() beats the env var
        assert backend_registry.get(OP, backend="slow").forward(q, k, v) == "slow"
        with pytest.raises(NoBackendError, match="fast: float32 not supported"):
            backend_registry.get(OP, backend="fast").forward(q, k, v)  # get() beats use()
        assert backend_registry.get(OP, backend="fast").forward(q, k, v, backend="slow") == "slow"  # call beats get


def test_forced_backend_names_the_forced_choice(fakes, monkeypatch):
    """The public ``forced_backend`` (what flash_attn_func reads before autograd may switch threads) follows the
    same precedence as dispatch: call > get > use() > env var, None when nothing forces one."""
    assert fakes.forced_backend() is None
    monkeypatch.setenv(backend_registry.ENV_VAR, "medium")
    assert fakes.forced_backend() == "medium"
    with backend_registry.use("slow"):
        assert fakes.forced_backend() == "slow"
        assert backend_registry.get(OP, backend="fast").forced_backend() == "fast"
        assert backend_registry.get(OP, backend="fast").forced_backend("slow") == "slow"
    monkeypatch.setenv(backend_registry.ENV_VAR, "")
    assert fakes.forced_backend() is None


def test_unknown_backend_and_op(rng, fakes, monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)
    with pytest.raises(NoBackendError, match=r"no such backend \(registered: fast, medium, slow\)\)$"):
        fakes.forward(*_qkv(rng), backend="tpu")
    with pytest.raises(NoBackendError, match=r"no such backend \(registered: fast, medium, slow\); did you mean "
                                             r"'slow'\?\)$"):
        fakes.forward(*_qkv(rng), backend="slwo")
    monkeypatch.setenv(backend_registry.ENV_VAR, "tpu")   # a typo in the environment is said to come from there
    with pytest.raises(NoBackendError, match=f"no such backend .*, named by the environment variable "
                                             f"{backend_registry.ENV_VAR}"):
        fakes.forward(*_qkv(rng))
    for ask in (backend_registry.get, backend_registry.available, backend_registry.names):
        with pytest.raises(KeyError, match="unknown op 'no_such_op'; registered ops: "):
            ask("no_such_op")   # available() and names() answered [] for a misspelt op
    with pytest.raises(ValueError, match="already registered"):
        backend_registry.register(OP, "fast", Fast)


def test_explain_names_choice_and_reasons(rng, fakes):
    text = fakes.explain(*_qkv(rng), causal=True)
    assert "chosen: slow" in text
    assert "fast [priority 50]: float32 not supported" in text
    assert "medium [priority 20]: pretend hardware missing" in text
    assert "slow [priority 5]: can serve  <- chosen" in text
    assert "causal" in text.splitlines()[0]


def test_dispatch_is_logged_at_debug(rng, fakes, caplog):
    with caplog.at_level(logging.DEBUG, logger="numba_flash"):
        fakes.forward(*_qkv(rng))
    assert any("-> slow" in r.getMessage() and "passed over fast: float32 not supported" in r.getMessage()
               for r in caplog.records)


def test_backward_dispatch(rng, fakes):
    q, k, v = _qkv(rng)
    lse = rng.standard_normal((1, 2, 5)).astype(np.float32)
    assert fakes.backward(q, q, k, v, q, lse) == ("slow", "slow", "slow")


def test_entry_point_backend(tmp_path, rng, monkeypatch):
    """A third-party backend declared in an installed distribution's entry points is found, imported only when
    first used, and can be forced."""
    pkg = tmp_path / "nf_plugin_backend"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        from backends.base import Backend

        class PluginBackend(Backend):
            PRIORITY = -5
            SUPPORTED_KINDS = ("numpy",)

            def forward(self, call):
                return "plugin", None
    """))
    dist = tmp_path / "nf_plugin_backend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nf-plugin-backend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[numba_flash.backends]\nplugin = nf_plugin_backend:PluginBackend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    backend_registry.refresh_entry_points()
    try:
        assert "nf_plugin_backend" not in sys.modules
        assert "plugin" in backend_registry.names("flash")
        assert backend_registry.get("flash", backend="plugin").forward(*_qkv(rng)) == "plugin"
        assert "nf_plugin_backend" in sys.modules
    finally:
        backend_registry.unregister("flash", "plugin")


def test_imports_stay_light():
    """Importing the packages and getting a dispatcher imports neither torch nor numba.cuda."""
    code = ("import sys, numba_flash, backends; from backends import backend_registry; "
            "backend_registry.get('flash'); "
            "bad = [m for m in ('torch', 'numba.cuda', 'cupy') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_broken_backend_module_is_reported_not_fatal(rng, fakes):
    backend_registry.register(OP, "broken", "nf_no_such_module_anywhere:Backend")
    try:
        assert fakes.forward(*_qkv(rng)) == "slow"
        text = fakes.explain(*_qkv(rng))
        assert "broken [priority 0]: failed to load: ModuleNotFoundError" in text
        with pytest.raises(NoBackendError, match="broken: failed to load"):
            fakes.forward(*_qkv(rng), backend="broken")
    finally:
        backend_registry.unregister(OP, "broken")


def test_explain_returns_text_that_reads_well_and_the_decision_as_data(rng, fakes):
    """In a notebook or REPL the explanation shows as its lines (not a quoted string full of \\n), and code can read
    the decision without parsing text."""
    import pickle

    exp = fakes.explain(*_qkv(rng), causal=True)
    assert isinstance(exp, str) and "chosen: slow" in exp       # print() and `in` as before
    assert repr(exp) == str(exp) and "\n" in repr(exp) and not repr(exp).startswith("'")
    assert exp.chosen == "slow" and exp.forced is None
    by_name = {c.name: c for c in exp.candidates}
    assert [c.name for c in exp.candidates] == ["fast", "medium", "slow"]
    assert by_name["fast"].reasons == ("float32 not supported",) and not by_name["fast"].chosen
    assert by_name["medium"].reasons == ("pretend hardware missing",)
    assert by_name["slow"].reasons == () and by_name["slow"].chosen and by_name["slow"].priority == 5
    html = exp._repr_html_()
    assert html.count("<tr>") == 1 + len(exp.candidates) and "<b>slow</b>" in html
    assert pickle.loads(pickle.dumps(exp)) == exp
    forced = fakes.explain(*_qkv(rng), backend="fast")
    assert forced.chosen is None and forced.forced == "fast" and "NoBackendError" in forced


def test_a_backend_registered_under_another_key_is_forced_by_that_key(rng):
    """get() refuses names nobody registered, but a registered key counts even where the backend's own name
    differs (one backend class registered twice, with other settings)."""
    from backends.cpu import CpuBackend

    backend_registry.register("flash", "cpu_alias_for_test", CpuBackend())
    try:
        q, k, v = (rng.standard_normal((1, 7, 2, 8)).astype(np.float32) for _ in range(3))
        out = backend_registry.get("flash", backend="cpu_alias_for_test").forward(q, k, v)
    finally:
        backend_registry.unregister("flash", "cpu_alias_for_test")
    assert np.max(np.abs(out - attention_ref(q, k, v)[0])) <= 1e-5
