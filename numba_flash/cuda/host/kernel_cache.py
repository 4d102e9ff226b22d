"""Compiled CUDA kernels kept on disk, so that a new process launches without compiling.

Each specialisation is one file, keyed by everything its machine code depends on: the kernel's name and factory
arguments (tile config, ``Variant``), the argument types of the launch, the compute capability, and
``kernel_sources.fingerprint()`` (the code of every module a kernel is built from, and the versions of Python, numba,
numba-cuda and the CUDA compiler packages). A changed kernel or toolchain makes a new key, so an old file is never
read for it.

numba-cuda's own ``cache=True`` is not used: its entries are stamped with the kernel function's own source file
only, so an edit to a device helper in another module (device/*.py, which every kernel inlines) would go unnoticed
and a stale kernel be loaded; and it is filled only by a launch on a GPU. Instead the dispatcher's cache slot (what ``Dispatcher.compile`` asks before compiling and
tells after, the same slot ``cache=True`` fills) gets a ``DiskCache`` that knows the specialisation's key: on a
launch of a new signature numba asks it, and a hit installs the stored kernel (its cubin for this GPU) without
lowering anything. The file holds what numba-cuda's own cache stores (``_Kernel``'s reduced state: PTX and cubins).

Files are written to a temporary name in the same directory and renamed over the entry (atomic: several processes
may write one entry at once, and a reader sees a whole file or none). A file is trusted only if its magic, its
SHA-256 checksum, its stored key and the rebuilt kernel (signature, a cubin for this compute capability) all agree;
otherwise it is recompiled with a ``KernelCacheWarning`` and overwritten. Kernels built with the user's mods are not
stored: the mods' code is not in the fingerprint. Under the CUDA simulator this module does nothing.

The directory: ``NUMBA_FLASH_CACHE_DIR``, else ``$NUMBA_CACHE_DIR/numba_flash_cuda``, else
``~/.cache/numba_flash/cuda`` (``XDG_CACHE_HOME`` honoured). ``NUMBA_FLASH_KERNEL_CACHE=0`` turns the cache off.
Like numba's cache, it loads pickles: the directory must be writable only by those you trust.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pickle
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

from numba_flash.cuda.kernel_sources import fingerprint, kernel_sources, toolchain_versions

#: Bumped when the file layout changes, so that old files are keyed apart rather than misread.
FORMAT = 1
MAGIC = b"numba-flash cuda kernel v1\n"
SUFFIX = ".nfk"
#: What this process's caches did, for the GPU check and the tests: entries loaded, signatures compiled (no usable
#: entry), entries written, files distrusted.
STATS = {"loaded": 0, "compiled": 0, "stored": 0, "distrusted": 0}


class KernelCacheWarning(UserWarning):
    """A cache file was unreadable, corrupt or stale (recompiled), or could not be written (kept in memory only)."""


def cache_dir() -> Path:
    """Where the compiled kernels are kept (see the module's docstring for the order of the variables)."""
    own = os.environ.get("NUMBA_FLASH_CACHE_DIR")
    if own:
        return Path(own)
    numba_dir = os.environ.get("NUMBA_CACHE_DIR")
    if numba_dir:
        return Path(numba_dir) / "numba_flash_cuda"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "numba_flash" / "cuda"


def enabled() -> bool:
    """Whether kernels go through the disk cache: not under the simulator (no machine code there), nor with
    ``NUMBA_FLASH_KERNEL_CACHE=0``."""
    from numba import config

    return not config.ENABLE_CUDASIM and os.environ.get("NUMBA_FLASH_KERNEL_CACHE", "1") != "0"


def code_fingerprint(package: Path | None = None) -> dict[str, Any]:
    """``kernel_sources.fingerprint()`` (of ``package``, default numba_flash's), once per process and, while no
    source file's size or modification time changes, read back from the cache directory: parsing the sources takes
    0.1-0.2 s, too much of a warm first call's budget. The toolchain's versions are read afresh (cheap)."""
    stats = hashlib.sha256()
    for path in kernel_sources(*([package] if package else [])):
        st = path.stat()
        stats.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return _memo_fingerprint(stats.hexdigest(), package)


def reset_fingerprint() -> None:
    """Forget this process's memo of ``code_fingerprint`` (for tests, and a process that upgrades its toolchain)."""
    _memo_fingerprint.cache_clear()


@functools.lru_cache(maxsize=8)
def _memo_fingerprint(stats: str, package: Path | None) -> dict[str, Any]:
    memo = cache_dir() / f"fingerprint-{stats[:32]}.json"
    try:
        found = json.loads(memo.read_text(encoding="utf-8"))
        # The sources' stat is in the name; the toolchain is not, so it is compared.
        if isinstance(found, dict) and "kernel_code_sha256" in found and found.get("toolchain") == toolchain_versions():
            return found
    except (OSError, ValueError):
        pass
    found = fingerprint(*([package] if package else []))
    # Quietly: a read-only cache (built in an image, used by another user) would otherwise warn in every process.
    _write_atomic(memo, json.dumps(found, sort_keys=True).encode(), note=False)
    return found


def entry_key(label: str, parts: tuple, argtypes: tuple, cc: tuple[int, int]) -> str:
    """The key of one specialisation, as canonical JSON text: what its compiled code depends on."""
    return json.dumps({"format": FORMAT, "kernel": label, "factory": [repr(p) for p in parts],
                       "argtypes": [str(t) for t in argtypes], "cc": f"{cc[0]}.{cc[1]}",
                       "code": code_fingerprint()}, sort_keys=True)


def entry_path(label: str, key: str) -> Path:
    """The file of the entry with ``key``: the kernel's name for a reader, a hash of the key for uniqueness."""
    return cache_dir() / f"{label}-{hashlib.sha256(key.encode()).hexdigest()[:32]}{SUFFIX}"


def _write_atomic(path: Path, data: bytes, note: bool = True) -> bool:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename: readers and other
    writers see the old file or the new one, never a part. False where it cannot write (with a warning if
    ``note``)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, 0o644)   # mkstemp's 0600 would hide a cache built in a container step from its other users
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        if note:
            warnings.warn(f"numba-flash: could not write {path} ({exc}); the kernel stays in memory only",
                          KernelCacheWarning, stacklevel=3)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False


def _target_cc() -> tuple[int, int]:
    """The compute capability numba compiles for: the current GPU's, or the one ``compiling_for`` names. Read
    through numba-cuda's dispatcher module because that is where ``compiling_for`` substitutes it."""
    from numba.cuda import dispatcher

    return tuple(dispatcher.get_current_device().compute_capability)


class DiskCache:
    """The dispatcher's cache slot for one specialisation (kernel ``label``, factory arguments ``parts``): numba's
    ``Dispatcher.compile`` calls ``load_overload`` before compiling a signature and ``save_overload`` after."""

    def __init__(self, label: str, parts: tuple) -> None:
        self.label, self.parts = label, parts

    def load_overload(self, sig: Any, target_context: Any = None) -> Any:
        """The stored kernel for ``sig`` on this compute capability, or None (numba then compiles)."""
        from numba.core import sigutils

        argtypes, _ = sigutils.normalize_signature(sig)
        cc = _target_cc()
        key = entry_key(self.label, self.parts, argtypes, cc)
        path = entry_path(self.label, key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            STATS["compiled"] += 1
            return None
        except OSError as exc:
            return _distrust(path, f"unreadable ({exc})")
        head = len(MAGIC)
        if not data.startswith(MAGIC) or len(data) < head + 32:
            return _distrust(path, "not a numba-flash kernel file, or truncated")
        digest, body = data[head:head + 32], data[head + 32:]
        if hashlib.sha256(body).digest() != digest:
            return _distrust(path, "checksum mismatch (truncated or corrupt)")
        try:
            entry = pickle.loads(body)
            if entry["key"] != key:
                return _distrust(path, "stale: stored for another key")
            from numba.cuda.dispatcher import _Kernel   # numba-cuda's own cache rebuilds kernels the same way

            kernel = _Kernel._rebuild(**entry["kernel"])
        except Exception as exc:   # a file that checksums but does not rebuild (another numba-cuda's layout)
            return _distrust(path, f"does not rebuild ({type(exc).__name__}: {exc})")
        library = kernel._codelibrary
        if tuple(kernel.argument_types) != tuple(argtypes) or not library._cubin_cache.get(library._ensure_cc(None)):
            return _distrust(path, "stale: its signature or its cubin does not match")
        if getattr(kernel, "launch_config_sensitive", False):
            return _distrust(path, "stale: compiled for one launch configuration")
        STATS["loaded"] += 1
        return kernel

    def save_overload(self, sig: Any, kernel: Any) -> None:
        """Store ``kernel`` (just compiled for ``sig``) with its cubin for this compute capability."""
        from numba.core import sigutils

        if getattr(kernel, "launch_config_sensitive", False):
            return   # its code depends on the launch configuration, which the key does not hold
        argtypes, _ = sigutils.normalize_signature(sig)
        cc = _target_cc()
        key = entry_key(self.label, self.parts, argtypes, cc)
        try:
            # The cubin the launch loads (numba keys it by its own target, e.g. (9, 0, "a")): linked already on a
            # GPU (Dispatcher.compile binds first); by nvJitLink, without a GPU, under compiling_for.
            kernel._codelibrary.get_cubin()
            body = pickle.dumps({"key": key, "kernel": kernel._reduce_states()}, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:   # e.g. a kernel linking extra files, which numba-cuda refuses to serialise
            warnings.warn(f"numba-flash: {self.label} cannot be stored on disk ({type(exc).__name__}: {exc})",
                          KernelCacheWarning, stacklevel=2)
            return
        if _write_atomic(entry_path(self.label, key), MAGIC + hashlib.sha256(body).digest() + body):
            STATS["stored"] += 1

    def flush(self) -> None:
        """numba's ``recompile`` empties a cache through this; entries stay, as they are keyed by their code."""


def _distrust(path: Path, why: str) -> None:
    """Note a file that will not be used (it is recompiled, and the new kernel written over it)."""
    STATS["distrusted"] += 1
    STATS["compiled"] += 1
    warnings.warn(f"numba-flash: kernel cache file {path} is {why}; recompiling", KernelCacheWarning, stacklevel=3)
    return None


def disk_cached(dispatcher: Any, label: str, *parts: Any) -> Any:
    """``dispatcher`` (a kernel factory's ``numba.cuda`` dispatcher for kernel ``label`` built with ``parts``) with
    its compiled signatures read from and written to the disk cache; returned as it is under the simulator, with
    the cache off, or when a part carries the user's mods (their code is not in the key). Idempotent and cheap: it
    runs on every launch."""
    if isinstance(getattr(dispatcher, "_cache", None), DiskCache) or not enabled():
        return dispatcher
    if any(getattr(getattr(p, "mods", None), "any", False) for p in parts):
        return dispatcher
    dispatcher._cache = DiskCache(label, parts)   # the slot numba's cache=True fills (dispatcher.enable_caching)
    return dispatcher


@contextlib.contextmanager
def compiling_for(cc: tuple[int, int]) -> Iterator[None]:
    """numba-cuda compiles for the current GPU, asked where a kernel is built (``dispatcher.get_current_device``)
    and where its code library picks its target (``codegen.devices.get_context``); in here both answer ``cc``, so
    that kernels compile and link for it without a GPU."""
    from numba.cuda import codegen, dispatcher

    device = SimpleNamespace(compute_capability=tuple(cc), id=-1)
    real_device, real_devices = dispatcher.get_current_device, codegen.devices
    dispatcher.get_current_device = lambda: device
    codegen.devices = SimpleNamespace(get_context=lambda *a, **k: SimpleNamespace(device=device))
    try:
        yield
    finally:
        dispatcher.get_current_device, codegen.devices = real_device, real_devices


def precompile(dispatcher: Any, label: str, parts: tuple, argtypes: tuple, cc: tuple[int, int]) -> bool:
    """Compile ``dispatcher``'s kernel (kernel ``label`` built with ``parts``) for ``argtypes`` and compute
    capability ``cc`` into the disk cache, no GPU needed, unless a valid entry is there; True if it compiled. The
    kernel is not installed in ``dispatcher``: it is for ``cc``, not for this process's GPU."""
    from numba.cuda.dispatcher import _Kernel

    cache = disk_cached(dispatcher, label, *parts)._cache
    if not isinstance(cache, DiskCache):
        raise ValueError(f"{label}: not cached on disk (the simulator, NUMBA_FLASH_KERNEL_CACHE=0, or user mods)")
    with compiling_for(cc):
        if cache.load_overload(argtypes) is not None:
            return False
        cache.save_overload(argtypes, _Kernel(dispatcher.py_func, argtypes, **dispatcher.targetoptions))
    return True
