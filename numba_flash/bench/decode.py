"""``numba-flash bench --decode``: one decoding step with a KV cache (Sq = 1) over a sweep of cache lengths.

Per cache length L it times, in the same run and on the same cache:

* each backend's ``with_kvcache`` step: q (B, 1, Hq, D) attends to a full cache (B, L, Hkv, D); ``cache_seqlens``
  = L and no new keys, so repeated calls never change the cache;
* torch SDPA on the same call (the peer): q (B, Hq, 1, D) and (B, Hkv, L, D) views of the same cache,
  ``enable_gqa=True``;
* the yardstick: a copy of the same number of bytes, 2 * B * L * Hkv * D * itemsize (numpy on the host, torch on a
  GPU), whose GB/s stands for the machine's memory bandwidth.

A decoding step reads every cached key and value once and does ~4 FLOPs per byte read, so its speed is a memory
speed: each row reports GB/s of cache read and what fraction of the copy's GB/s that is. The copy counts the bytes
it copies once (STREAM would count them twice, read and write), so a pure read stream can pass 100%.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .cases import DTYPES, MAX_HEAD_DIM, BenchArgumentError, Skip, to_host64
from .harness import (Clock, TimingStats, busy_note, matched_torch_threads, optional_torch, time_calls,
                      timing_fields)
from .memory import available_host_bytes, fits_in_memory, gib

# The decode point: a Llama-style GQA model (32 query heads, 8 key/value heads, D = 128), one sequence.
DECODE_DEFAULTS = {"batch": 1, "nheads": 32, "nheads_kv": 8, "headdim": 128}
DEFAULT_CACHE_LENS = (8192, 16384, 32768, 65536)
DECODE_PEERS = ("torch",)
COPY = "copy"
DECODE_COLUMNS = ("mode", "batch", "nheads", "nheads_kv", "cache_len", "headdim", "dtype", "name", "kind", "device",
                  "status", "repeats", "min_ms", "median_ms", "p95_ms", "p99_ms", "max_ms", "spread", "cache_bytes",
                  "gbps", "frac_of_copy", "speedup_vs_sdpa", "max_err")


@dataclass(frozen=True)
class DecodeCase:
    """One decoding step: q (B, 1, Hq, D) against a full cache (B, cache_len, Hkv, D) of ``dtype``."""

    batch: int
    nheads: int
    nheads_kv: int
    cache_len: int
    headdim: int
    dtype: str      # 'float32', 'float16', 'bfloat16'

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def cache_bytes(self) -> int:
        """Bytes of keys and values one step reads: 2 * B * L * Hkv * D * itemsize."""
        return 2 * self.batch * self.cache_len * self.nheads_kv * self.headdim * self.itemsize

    def describe(self, lens: Sequence[int] | None = None) -> str:
        text = ",".join(str(x) for x in lens) if lens else str(self.cache_len)
        return (f"decode B={self.batch} Hq={self.nheads} Hkv={self.nheads_kv} Sq=1 cache_len={text} "
                f"D={self.headdim} {self.dtype}")


def make_decode_cases(batch: int | None = None, nheads: int | None = None, nheads_kv: int | None = None,
                      headdim: int | None = None, cache_lens: Sequence[int] | None = None,
                      dtype: str = "fp32") -> list[DecodeCase]:
    """One case per cache length, ``DECODE_DEFAULTS`` for what is not given. BenchArgumentError names a bad one."""
    b = batch or DECODE_DEFAULTS["batch"]
    hq = nheads or DECODE_DEFAULTS["nheads"]
    # An explicit --nheads without --nheads-kv means no GQA, as in the dense bench.
    hkv = nheads_kv or (hq if nheads else DECODE_DEFAULTS["nheads_kv"])
    d = headdim or DECODE_DEFAULTS["headdim"]
    if dtype not in DTYPES:
        raise BenchArgumentError(f"dtype: unknown {dtype!r}; choose from {', '.join(DTYPES)}")
    if hq % hkv:
        raise BenchArgumentError(f"nheads {hq} must be a multiple of nheads_kv {hkv}")
    if d > MAX_HEAD_DIM:
        raise BenchArgumentError(f"headdim {d} is larger than {MAX_HEAD_DIM}, the most every benchmarked backend supports")
    lens = list(cache_lens or DEFAULT_CACHE_LENS)
    if any(int(x) < 1 for x in lens):
        raise BenchArgumentError(f"cache_lens: expected positive lengths, got {lens}")
    return [DecodeCase(int(b), int(hq), int(hkv), int(x), int(d), DTYPES[dtype]) for x in lens]


def resolve_backends(backends: str | Sequence[str] | None, kvcache: bool) -> list[str]:
    """The named backends (default: every available one, with ``kvcache`` only those that implement
    ``with_kvcache``). BenchArgumentError for an unknown name."""
    from numba_flash import backend_registry

    registered = backend_registry.names("flash")
    if backends is None:
        kv = {be.name for be in backend_registry.backends("flash") if be.SUPPORTS_KVCACHE or not kvcache}
        return [n for n in backend_registry.available("flash") if n in kv]
    chosen = [x.strip() for x in (backends.split(",") if isinstance(backends, str) else backends) if x.strip()]
    unknown = [x for x in chosen if x not in registered]
    if unknown or not chosen:
        raise BenchArgumentError(f"backend: unknown backend {', '.join(unknown) or repr(backends)}; "
                                 f"registered: {', '.join(registered)}")
    return chosen


def decode_peers(compare: str | Sequence[str] | None) -> list[str]:
    """torch SDPA unless ``compare`` is 'none'; the other peers materialise scores and have no decode meaning."""
    if compare is None:
        return list(DECODE_PEERS)
    names = [x.strip() for x in (compare.split(",") if isinstance(compare, str) else compare) if x.strip()]
    if names == ["none"]:
        return []
    bad = [x for x in names if x not in DECODE_PEERS]
    if bad or not names:
        raise BenchArgumentError(f"compare: --decode compares with torch (SDPA) or none, got {compare!r}")
    return names


@dataclass
class DecodeRow:
    """One line of the decode report: a backend, the SDPA peer or the copy yardstick at one cache length."""

    case: DecodeCase
    name: str
    kind: str            # 'backend', 'peer' or 'yardstick'
    device: str
    status: str = "ok"
    times_ms: list[float] | None = None
    max_err: float | None = None
    frac_of_copy: float | None = None
    speedup_vs_sdpa: float | None = None

    @property
    def stats(self) -> TimingStats | None:
        return TimingStats.of(self.times_ms) if self.times_ms else None

    @property
    def gbps(self) -> float | None:
        """GB/s (1e9 bytes) of cache read at the median time."""
        s = self.stats
        return self.case.cache_bytes / (s.p50_ms * 1e-3) / 1e9 if s and s.p50_ms > 0 else None

    @property
    def label(self) -> str:
        return f"{self.name} ({self.device}) decode L={self.case.cache_len}"

    def record(self) -> dict[str, Any]:
        c = self.case
        return {"mode": "decode", "batch": c.batch, "nheads": c.nheads, "nheads_kv": c.nheads_kv,
                "cache_len": c.cache_len, "headdim": c.headdim, "dtype": c.dtype, "name": self.name,
                "kind": self.kind, "device": self.device, "status": self.status, **timing_fields(self.stats),
                "cache_bytes": c.cache_bytes, "gbps": self.gbps, "frac_of_copy": self.frac_of_copy,
                "speedup_vs_sdpa": self.speedup_vs_sdpa, "max_err": self.max_err}


@dataclass
class DecodeInputs:
    """N(0, 1) q (B, 1, Hq, D) and caches (B, L, Hkv, D), drawn in float32 and rounded once to the case's dtype:
    numpy arrays, or torch CPU tensors for bfloat16 (numpy has none). ``bytes_of`` gives a uint8 view of a cache."""

    case: DecodeCase
    q: Any
    k_cache: Any
    v_cache: Any
    cache_seqlens: np.ndarray   # (B,) int32, every sequence's cache full

    @classmethod
    def draw(cls, case: DecodeCase, rng: np.random.Generator) -> "DecodeInputs":
        b, hq, hkv, n, d = case.batch, case.nheads, case.nheads_kv, case.cache_len, case.headdim
        arrays = [rng.standard_normal(shape, dtype=np.float32) for shape in
                  ((b, 1, hq, d), (b, n, hkv, d), (b, n, hkv, d))]
        if case.dtype == "bfloat16":
            torch = optional_torch()
            if torch is None:
                raise Skip("bfloat16 needs torch (numpy has no bfloat16)")
            arrays = [torch.from_numpy(a).to(torch.bfloat16) for a in arrays]
        else:
            arrays = [a.astype(case.dtype, copy=False) for a in arrays]
        return cls(case, *arrays, np.full(b, n, dtype=np.int32))

    @staticmethod
    def bytes_of(a: Any) -> np.ndarray:
        if isinstance(a, np.ndarray):
            return a.reshape(-1).view(np.uint8)
        import torch

        return a.reshape(-1).view(torch.uint8).numpy()

    def torch_on(self, device: str) -> dict[str, Any]:
        """q and the caches as torch tensors on ``device``, sharing memory with the host arrays on the CPU."""
        torch = optional_torch()
        if torch is None:
            raise Skip("torch not installed")
        conv = (lambda a: a) if not isinstance(self.q, np.ndarray) else torch.from_numpy
        return {n: conv(getattr(self, n)).to(device) for n in ("q", "k_cache", "v_cache")}

    def reference_head0(self) -> np.ndarray:
        """The float64 reference output of the query heads of KV head 0, (B, 1, Hq / Hkv, D): the whole call's
        reference at L = 64k would copy both caches to float64 (1 GiB); one KV head's slice checks the same
        kernel path at 1 / Hkv of the cost."""
        from ..reference import attention_ref_kvcache

        group = self.case.nheads // self.case.nheads_kv
        return attention_ref_kvcache(self.q[:, :, :group], self.k_cache[:, :, :1], self.v_cache[:, :, :1],
                                     cache_seqlens=self.cache_seqlens)[0]


@dataclass
class Step:
    """One timed call of the decode bench, warmed up (the first call compiles): ``fn`` with no arguments,
    ``device`` where it runs ('cpu', 'cuda') and ``api`` the clock that times it ('host', 'torch-cuda'). The bench
    and the asv suite time the same steps."""

    fn: Callable[[], Any]
    device: str
    api: str


def _backend_forms(inputs: DecodeInputs) -> list[tuple[str, str, Callable[[], dict[str, Any]]]]:
    """Where a backend may run and with which arrays, in the order tried: a torch GPU first, then the host."""
    from .runners import torch_cuda_available

    forms: list[tuple[str, str, Callable[[], dict[str, Any]]]] = []
    if torch_cuda_available():
        forms.append(("cuda", "torch-cuda", lambda: inputs.torch_on("cuda")))
    forms.append(("cpu", "host", lambda: {"q": inputs.q, "k_cache": inputs.k_cache, "v_cache": inputs.v_cache}))
    if isinstance(inputs.q, np.ndarray):
        forms.append(("cpu", "host", lambda: inputs.torch_on("cpu")))
    return forms


def backend_step(name: str, inputs: DecodeInputs) -> Step:
    """Backend ``name``'s ``with_kvcache`` step (no new keys, so it never writes the cache) on the first array
    kind it serves; Skip with every reason when it serves none."""
    from numba_flash import backend_registry
    from numba_flash.errors import NoBackendError

    op = backend_registry.get("flash", backend=name)
    why: list[str] = []
    for device, api, make in _backend_forms(inputs):
        try:
            a = make()
        except Skip as exc:
            why.append(str(exc))
            continue
        sl = inputs.cache_seqlens if device == "cpu" else optional_torch().from_numpy(inputs.cache_seqlens).to(device)

        def fn(a: dict[str, Any] = a, sl: Any = sl) -> Any:
            return op.with_kvcache(a["q"], a["k_cache"], a["v_cache"], cache_seqlens=sl)

        try:
            fn()  # the first call compiles, and says whether this backend serves these arrays at all
        except NoBackendError as exc:
            why.append(str(exc).splitlines()[0])
            continue
        return Step(fn, device, api)
    raise Skip("; ".join(dict.fromkeys(why)))


def sdpa_step(inputs: DecodeInputs) -> Step:
    """torch SDPA on the same call: (B, Hq, 1, D) against (B, Hkv, L, D) views of the cache, GQA in torch."""
    from .. import bench_peers
    from .runners import torch_cuda_available

    device = "cuda" if torch_cuda_available() else "cpu"
    a = inputs.torch_on(device)
    torch = optional_torch()

    def fn() -> Any:
        with torch.no_grad():
            return bench_peers.sdpa_torch(a["q"], a["k_cache"], a["v_cache"], False, "bshd")

    fn()
    return Step(fn, device, "torch-cuda" if device == "cuda" else "host")


def copy_step(inputs: DecodeInputs, device: str = "cpu") -> Step:
    """The bandwidth yardstick: copy both caches' bytes into buffers of the same size on ``device`` (numpy on the
    host, one thread; torch on a GPU)."""
    if device == "cpu":
        src = [inputs.bytes_of(inputs.k_cache), inputs.bytes_of(inputs.v_cache)]
        dst = [np.empty_like(x) for x in src]

        def fn() -> None:
            for d, x in zip(dst, src):
                np.copyto(d, x)
    else:
        torch = optional_torch()
        src = [torch.from_numpy(inputs.bytes_of(a)).to(device) for a in (inputs.k_cache, inputs.v_cache)]
        dst = [torch.empty_like(x) for x in src]

        def fn() -> None:
            for d, x in zip(dst, src):
                d.copy_(x)
    fn()  # the first copy faults the destination's pages in; that is not bandwidth
    return Step(fn, device, "host" if device == "cpu" else "torch-cuda")


def max_err_head0(out: Any, ref: np.ndarray) -> float:
    """Max abs error of the query heads of KV head 0 of a step's output (B, 1, Hq, D) against ``ref``."""
    return float(np.max(np.abs(to_host64(out)[:, :, :ref.shape[2]] - ref)))


def measure(row: DecodeRow, step: Step, repeats: int, ref: np.ndarray | None) -> DecodeRow:
    """Time ``repeats`` calls of ``step`` into ``row``, then the error of one more call's output."""
    row.device = step.device
    row.times_ms = time_calls(step.fn, repeats, Clock(step.api), warmup=0)
    if ref is not None and row.kind != "yardstick":
        row.max_err = max_err_head0(step.fn(), ref)
    return row


def _add_ratios(rows: list[DecodeRow]) -> None:
    """Each row's GB/s as a fraction of the copy's on its device, and its speedup over SDPA on its device."""
    ok = {(r.name, r.device): r for r in rows if r.status == "ok"}
    for r in rows:
        if r.status != "ok" or r.kind == "yardstick":
            continue
        copy, sdpa = ok.get((COPY, r.device)), ok.get(("torch", r.device))
        if copy is not None and copy.gbps:
            r.frac_of_copy = r.gbps / copy.gbps
        if sdpa is not None and r is not sdpa:
            r.speedup_vs_sdpa = sdpa.stats.p50_ms / r.stats.p50_ms


def run_decode_case(case: DecodeCase, backends: Sequence[str], peers: Sequence[str], repeats: int, check: bool,
                    rng: np.random.Generator, tick: Callable[[], None] = lambda: None,
                    notes: list[str] | None = None) -> list[DecodeRow]:
    """Every backend, peer and the copy on one cache length, on caches drawn for it alone (freed on return)."""
    # The caches, the copy's destination, and SDPA's worst case: its math path expands k and v to Hq heads.
    needed = (2 + (case.nheads // case.nheads_kv if peers else 0)) * case.cache_bytes
    available = available_host_bytes()
    if not fits_in_memory(needed, available):
        if notes is not None:
            notes.append(f"skipped L={case.cache_len}: needs about {gib(needed)}, {gib(available)} available")
        return [DecodeRow(case, n, "backend", "cpu", status=f"skipped: needs about {gib(needed)} of host memory")
                for n in backends]
    inputs = DecodeInputs.draw(case, rng)
    ref = inputs.reference_head0() if check else None
    rows: list[DecodeRow] = []
    runs: list[tuple[str, str, Callable[[], Step]]] = [(n, "backend", lambda n=n: backend_step(n, inputs))
                                                       for n in backends]
    runs += [(p, "peer", lambda: sdpa_step(inputs)) for p in peers]
    for name, kind, make_step in runs:
        try:
            rows.append(measure(DecodeRow(case, name, kind, "cpu"), make_step(), repeats, ref))
        except Skip as exc:
            rows.append(DecodeRow(case, name, kind, "cpu", status=f"skipped: {exc}"))
        except Exception as exc:  # report and go on: one broken backend must not hide the others' figures
            msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            rows.append(DecodeRow(case, name, kind, "cpu", status=f"error: {msg}"))
        tick()
    for device in dict.fromkeys(["cpu"] + [r.device for r in rows if r.status == "ok"]):
        rows.append(measure(DecodeRow(case, COPY, "yardstick", device), copy_step(inputs, device), repeats, None))
    tick()
    _add_ratios(rows)
    return rows


def execute_decode(cases: Sequence[DecodeCase], backends: Sequence[str], peers: Sequence[str], *, repeats: int = 10,
                   check: bool = True, seed: int | None = None, progress: bool | None = None,
                   on_start: Callable[[dict[str, Any]], None] | None = None) -> tuple[list[DecodeRow], dict, list]:
    """The sweep: rows, the run's metadata and the notes to print under the table (torch threads matched to
    Numba's for the duration, as in the dense bench)."""
    from .engine import progress_bar
    from .report import machine_info

    seed = seed if seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    rows: list[DecodeRow] = []
    notes: list[str] = []
    with matched_torch_threads():
        meta = machine_info()
        meta.update(seed=seed, repeats=repeats, mode="decode")
        if on_start is not None:
            on_start(meta)
        total = len(cases) * (len(backends) + len(peers) + 1)
        with progress_bar(total, enabled=len(cases) > 1 if progress is None else progress) as tick:
            for case in cases:
                rows.extend(run_decode_case(case, backends, peers, repeats, check, rng, tick, notes))
    notes.extend(busy_note(r.label, r.stats) for r in rows if r.status == "ok" and r.stats and r.stats.busy)
    return rows, meta, notes

