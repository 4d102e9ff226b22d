"""What softcap and ALiBi cost the CPU backend's KV-cache decode against the plain call, in one run.

    .venv/bin/python tools/decode_variant_cost.py [--repeats 9] [--label new]

B = 4 sequences of 16384 cached keys, Hq = 32, Hkv = 8, D = 128, float32, one query token each; softcap 30, ALiBi
slopes 2**-(1 + h / 2). Each variant is called once first (compiles), then the variants take turns so that a busy
moment falls on all of them. Prints min and median ms per variant and the median's ratio to the plain call's. To
compare two revisions, run it from each one's tree (``PYTHONPATH=<tree>``) in turn: the plain call, whose code a
change to the variants leaves alone, is the yardstick between the runs."""

from __future__ import annotations

import argparse

import numpy as np
from score_mod_cost import print_against, time_in_turns

from numba_flash import backend_registry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--label", default="", help="printed at the start of each line")
    args = parser.parse_args()
    op = backend_registry.get("flash", backend="cpu")
    rng = np.random.default_rng(0)
    batch, heads, heads_kv, dim, cached = 4, 32, 8, 128, 16384
    q = rng.standard_normal((batch, 1, heads, dim), dtype=np.float32)
    k_cache, v_cache = (rng.standard_normal((batch, cached, heads_kv, dim), dtype=np.float32) for _ in range(2))
    lens = np.full(batch, cached, np.int32)
    slopes = (2.0 ** -(1.0 + np.arange(heads) / 2.0)).astype(np.float32)
    calls = {"plain": {}, "softcap": {"softcap": 30.0}, "alibi": {"alibi_slopes": slopes},
             "softcap+alibi": {"softcap": 30.0, "alibi_slopes": slopes}}
    times = time_in_turns({name: (lambda kw=kw: op.with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, **kw))
                           for name, kw in calls.items()}, args.repeats)
    print_against(times, label=f"{args.label:6s}")


if __name__ == "__main__":
    main()
