"""The compiled kernels kept on disk (numba_flash/cuda/host/kernel_cache.py), with the real compiler and no GPU: a
hit gives the bytes a fresh compile gives, a miss compiles, a changed source or toolchain misses, a corrupt file is
recompiled with a warning and never used, and two processes writing one entry at once leave one valid file.

One small kernel (the backward's delta pre-pass, about a second to compile) is compiled once for the module and
stored, loaded and damaged as each test needs."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import time
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.ptx

CC = (8, 0)
LABEL = "backward_delta"


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache directory per test, and the process's fingerprint memo forgotten around it."""
    from numba_flash.cuda.host import kernel_cache

    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("NUMBA_FLASH_KERNEL_CACHE", raising=False)
    kernel_cache.reset_fingerprint()
    yield tmp_path / "cache"
    kernel_cache.reset_fingerprint()


def _signature():
    from numba import types

    x, rows, i64 = types.Array(types.float32, 4, "C"), types.Array(types.float32, 3, "C"), types.int64
    return (x, x, rows) + (i64,) * 6   # sizes, rows, and the parts delta is summed in (and their width)


def _fresh_kernel():
    """The delta kernel compiled and linked for CC, no cache involved."""
    from numba.cuda.dispatcher import _Kernel

    from numba_flash.cuda.host.kernel_cache import compiling_for
    from numba_flash.cuda.kernels.backward_dkdv import make_delta_kernel

    dispatcher = make_delta_kernel(False)
    with compiling_for(CC):
        kernel = _Kernel(dispatcher.py_func, _signature(), **dispatcher.targetoptions)
        kernel._codelibrary.get_cubin()
    return kernel


@pytest.fixture(scope="module")
def fresh():
    pytest.importorskip("numba.cuda")
    pytest.importorskip("cuda.bindings.nvjitlink")
    return _fresh_kernel()


def _cubin(kernel) -> bytes:
    lib = kernel._codelibrary
    code = lib._cubin_cache[(CC[0], CC[1], "")]
    return bytes(getattr(code, "code", code))


def _ptx(kernel) -> str:
    return "".join(str(p) for p in kernel._codelibrary._ptx_cache.values())


def _cache():
    from numba_flash.cuda.host.kernel_cache import DiskCache

    return DiskCache(LABEL, (False,))


def _load():
    from numba_flash.cuda.host.kernel_cache import compiling_for

    with compiling_for(CC):
        return _cache().load_overload(_signature())


def _store(kernel, parts=(False,)) -> Path:
    """Store ``kernel`` as the entry of ``parts``; its file."""
    from numba_flash.cuda.host.kernel_cache import DiskCache, compiling_for, entry_key, entry_path

    with compiling_for(CC):
        DiskCache(LABEL, parts).save_overload(_signature(), kernel)
        path = entry_path(LABEL, entry_key(LABEL, parts, _signature(), CC))
    assert path.exists()
    return path


def _entries() -> list[Path]:
    from numba_flash.cuda.host.kernel_cache import SUFFIX, cache_dir

    return sorted(cache_dir().glob(f"*{SUFFIX}")) if cache_dir().exists() else []


def test_a_hit_gives_the_bytes_of_a_fresh_compile(fresh):
    path = _store(fresh)
    assert path.name.startswith(LABEL + "-")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = _load()
    assert loaded is not None and loaded is not fresh
    assert _cubin(loaded) == _cubin(fresh) and len(_cubin(loaded)) > 1000
    assert _ptx(loaded) == _ptx(fresh) and ".entry" in _ptx(loaded)
    assert tuple(loaded.argument_types) == _signature()


def test_a_warm_dispatcher_compiles_nothing(fresh):
    """numba's own Dispatcher.compile asks the slot disk_cached fills, and installs what it gets: no lowering (a
    compile here would need a GPU to bind, and raise)."""
    from numba_flash.cuda.host.kernel_cache import compiling_for, disk_cached
    from numba_flash.cuda.kernels.backward_dkdv import make_delta_kernel

    _store(fresh)
    dispatcher = make_delta_kernel(False)
    dispatcher.overloads.pop(_signature(), None)
    with compiling_for(CC):
        t0 = time.perf_counter()
        kernel = disk_cached(dispatcher, LABEL, False).compile(_signature())
        seconds = time.perf_counter() - t0
    assert dispatcher.overloads[_signature()] is kernel and _cubin(kernel) == _cubin(fresh)
    assert seconds < 0.5, seconds
    dispatcher.overloads.pop(_signature(), None)   # compiled for CC, not for a GPU of this process


def test_a_miss_finds_nothing_and_precompile_fills_it(fresh):
    from numba_flash.cuda.host import kernel_cache
    from numba_flash.cuda.kernels.backward_dkdv import make_delta_kernel

    before = dict(kernel_cache.STATS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _load() is None
    assert kernel_cache.STATS["compiled"] == before["compiled"] + 1
    assert kernel_cache.precompile(make_delta_kernel(False), LABEL, (False,), _signature(), CC) is True
    assert kernel_cache.precompile(make_delta_kernel(False), LABEL, (False,), _signature(), CC) is False
    # Not byte-equal to ``fresh``: each compile in a process names its function with a new number.
    loaded = _load()
    assert loaded is not None and len(_cubin(loaded)) > 1000


def test_other_factory_arguments_or_compute_capability_miss(fresh):
    from numba_flash.cuda.host.kernel_cache import DiskCache, compiling_for

    _store(fresh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # plain misses: no file under those keys (not one found and distrusted)
        with compiling_for(CC):
            assert DiskCache(LABEL, (True,)).load_overload(_signature()) is None
        with compiling_for((9, 0)):
            assert _cache().load_overload(_signature()) is None


def test_a_changed_kernel_source_misses(fresh, monkeypatch):
    from numba_flash.cuda.host import kernel_cache

    _store(fresh)
    real = kernel_cache.code_fingerprint()
    monkeypatch.setattr(kernel_cache, "code_fingerprint",
                        lambda package=None: dict(real, kernel_code_sha256="0" * 64))
    assert _load() is None


def test_the_fingerprint_follows_an_edit_of_a_kernel_source(tmp_path):
    from numba_flash.cuda.host import kernel_cache
    from numba_flash.cuda.kernel_sources import kernel_sources

    package = Path(kernel_cache.__file__).resolve().parents[2]
    copy = tmp_path / "pkg"
    for path in kernel_sources(package):
        (copy / path.relative_to(package)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, copy / path.relative_to(package))
    before = kernel_cache.code_fingerprint(copy)
    assert kernel_cache.code_fingerprint(copy) == before   # memoised, and read back from the memo file
    target = copy / "cuda" / "kernels" / "backward_dkdv.py"
    target.write_text(target.read_text() + "\nEDITED = 1\n")
    assert kernel_cache.code_fingerprint(copy)["kernel_code_sha256"] != before["kernel_code_sha256"]


def test_a_changed_toolchain_misses(fresh, monkeypatch):
    from numba_flash.cuda import kernel_sources
    from numba_flash.cuda.host import kernel_cache

    _store(fresh)
    real = kernel_sources.toolchain_versions()

    def newer(distributions=kernel_sources.TOOLCHAIN):
        return dict(real, **{"numba-cuda": "99.0"})

    monkeypatch.setattr(kernel_sources, "toolchain_versions", newer)
    monkeypatch.setattr(kernel_cache, "toolchain_versions", newer)
    kernel_cache.reset_fingerprint()   # as a new process after an upgrade: the memo file is what it reads
    assert kernel_cache.code_fingerprint()["toolchain"]["numba-cuda"] == "99.0"
    assert _load() is None


def _damaged(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(b"\0" * 100)
    else:   # one bit of the cubin flipped: a file that still unpickles, caught by the checksum alone
        from numba_flash.cuda.host.kernel_cache import MAGIC

        start = data.index(b"\x7fELF", len(MAGIC) + 32) + 200
        path.write_bytes(data[:start] + bytes([data[start] ^ 1]) + data[start + 1:])


@pytest.mark.parametrize("how", ["truncated", "garbage", "bit flipped"])
def test_a_corrupt_file_is_recompiled_with_a_warning_never_used(fresh, how):
    from numba_flash.cuda.host.kernel_cache import KernelCacheWarning

    path = _store(fresh)
    _damaged(path, how)
    with pytest.warns(KernelCacheWarning, match="recompiling"):
        assert _load() is None
    _store(fresh)   # what numba does next: compile, and save over it
    assert _cubin(_load()) == _cubin(fresh)


def test_a_file_stored_for_another_key_is_stale(fresh):
    from numba_flash.cuda.host.kernel_cache import KernelCacheWarning

    other = _store(fresh, (True,))   # the same kernel under another key
    shutil.copy(other, _store(fresh))
    with pytest.warns(KernelCacheWarning, match="stale"):
        assert _load() is None


def _writer(cache: str, barrier, rounds: int) -> None:
    """A process that compiles the kernel itself, then writes its entry ``rounds`` times as fast as it can."""
    os.environ["NUMBA_FLASH_CACHE_DIR"] = cache
    from numba_flash.cuda.host.kernel_cache import compiling_for

    kernel = _fresh_kernel()
    barrier.wait()
    with compiling_for(CC):
        for _ in range(rounds):
            _cache().save_overload(_signature(), kernel)


@pytest.mark.slow
def test_two_processes_writing_one_entry_at_once(fresh, cache_dir):
    """Both succeed; a reader meanwhile sees no file or a whole one, never a part; one valid file is left."""
    from numba_flash.cuda.host.kernel_cache import KernelCacheWarning

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(3)
    writers = [ctx.Process(target=_writer, args=(str(cache_dir), barrier, 40)) for _ in range(2)]
    for w in writers:
        w.start()
    barrier.wait(timeout=300)
    reads = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelCacheWarning)   # a torn file would warn: fail on it
        while any(w.is_alive() for w in writers):
            kernel = _load()
            reads += kernel is not None
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    assert reads > 0
    assert [p.name for p in cache_dir.iterdir() if p.suffix != ".json"] == [_entries()[0].name]   # no temp left
    # A writer's own compile: its bytes are not ``fresh``'s, as numba numbers each compile's function in a process.
    loaded = _load()
    assert loaded is not None and _cubin(loaded).startswith(b"\x7fELF") and loaded.argument_types == _signature()


def test_disk_cached_attaches_once_and_not_for_mods_or_when_off(monkeypatch):
    from types import SimpleNamespace

    from numba_flash.cuda.host.kernel_cache import DiskCache, disk_cached

    fake = SimpleNamespace(_cache=None)
    assert disk_cached(fake, "forward", "cfg") is fake and isinstance(fake._cache, DiskCache)
    first = fake._cache
    disk_cached(fake, "forward", "cfg")
    assert fake._cache is first
    with_mods = SimpleNamespace(_cache=None)
    disk_cached(with_mods, "forward", "cfg", SimpleNamespace(mods=SimpleNamespace(any=True)))
    assert with_mods._cache is None
    monkeypatch.setenv("NUMBA_FLASH_KERNEL_CACHE", "0")
    off = SimpleNamespace(_cache=None)
    disk_cached(off, "forward", "cfg")
    assert off._cache is None


def test_the_directory_honours_the_variables(monkeypatch, tmp_path):
    from numba_flash.cuda.host.kernel_cache import cache_dir

    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(tmp_path / "own"))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    assert cache_dir() == tmp_path / "own"
    monkeypatch.delenv("NUMBA_FLASH_CACHE_DIR")
    assert cache_dir() == tmp_path / "numba" / "numba_flash_cuda"
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "numba_flash" / "cuda"


def test_an_unwritable_directory_warns_and_goes_on(fresh, monkeypatch, tmp_path):
    from numba_flash.cuda.host.kernel_cache import KernelCacheWarning, compiling_for

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(blocker / "cache"))
    with compiling_for(CC), pytest.warns(KernelCacheWarning, match="could not write"):
        _cache().save_overload(_signature(), fresh)


def test_a_read_only_cache_loads_without_a_word(fresh, cache_dir, monkeypatch):
    """A cache filled in an image and read by a user who cannot write it: hits, and no warning per process."""
    from numba_flash.cuda.host import kernel_cache

    _store(fresh)
    for memo in cache_dir.glob("fingerprint-*.json"):
        memo.unlink()   # the memo too is then never written: it must not warn either
    kernel_cache.reset_fingerprint()

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(kernel_cache.tempfile, "mkstemp", refused)   # as a directory this user cannot write
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _cubin(_load()) == _cubin(fresh)
