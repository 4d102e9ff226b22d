"""User mods shared by the tests of every backend that runs them (``tests/numba_flash/test_mods_backends.py``, the
CUDA kernels' ``tests/numba_flash/cuda/test_mods_sim.py``): a document mask, a per-head distance bias and a soft
clip of the score that also hides one key, written as a user would, with global tables. Imported by the test files
(pytest puts ``tests/`` on sys.path).
"""

from __future__ import annotations

import math

import numpy as np

SLOPES = np.array([0.05, -0.1, 0.2, 0.0])   # per query head, up to 4 heads
# The key soft_clip hides from every row: in the second document of each test's layout, where the masks leave it
# visible to some rows, so that a NaN in its value reaches them unless the kernels ask score_mod.
HIDDEN_KEY = 10


def document_mods(docs: np.ndarray, sq: int, sk: int, blind_rows: int):
    """(doc_mask, head_bias) for keys in documents ``docs`` (one id per key position, ``sk`` of them) and ``sq``
    queries at the end of the keys (query i is at position i + sk - sq): a query sees the keys of its document,
    except that the first ``blind_rows`` rows see no key at all (their output must be 0 and their lse +inf);
    head_bias is an ALiBi-like distance term per head, plus 0.3 per batch index."""
    shift = sk - sq

    def doc_mask(b, h, q_idx, kv_idx):
        return q_idx >= blind_rows and docs[q_idx + shift] == docs[kv_idx]

    def head_bias(b, h, q_idx, kv_idx):
        return SLOPES[h] * abs(q_idx + shift - kv_idx) + 0.3 * b

    return doc_mask, head_bias


# The set every CPU test of mods runs (tests/numba_flash/test_mods_backends.py at Sq = 29, Sk = 45,
# tests/numba_flash/cpu/test_mods_kernels.py at Sq = 203, Sk = 219): the cpu backend compiles the hooks around
# them once per set of functions in a process (seconds each), so the files share these objects. Both
# shapes put query i at key position i + 16; the first 45 keys are five short documents, the rest three long ones
# that leave some of the kernels' 64 x 64 tiles empty and some full at the larger shape.
CPU_SHIFT = 16
CPU_DOCS = np.repeat(np.arange(8), [9, 14, 1, 6, 15, 70, 3, 101])
cpu_doc_mask, cpu_head_bias = document_mods(CPU_DOCS, 29, 29 + CPU_SHIFT, blind_rows=4)


def soft_clip(score, b, h, q_idx, kv_idx):
    # HIDDEN_KEY is hidden from every row (-inf from a score_mod hides a key as a mask does)
    return -math.inf if kv_idx == HIDDEN_KEY else 4.0 * math.tanh(score / 4.0) + 0.02 * (kv_idx % 5)


def soft_clip_grad(score, b, h, q_idx, kv_idx):
    t = math.tanh(score / 4.0)
    return 1.0 - t * t


def nan_value_reaches_without_score_mod(q, k, v, kw) -> bool:
    """Whether batch 0's output would hold a NaN (from V at HIDDEN_KEY) if score_mod did not hide the key: a test
    that puts NaN there is only live if so (float64 reference, same masks)."""
    from numba_flash import attention_ref

    plain = {n: x for n, x in kw.items() if n not in ("score_mod", "score_mod_grad")}
    return bool(np.isnan(attention_ref(q, k, v, **plain)[0][0]).any())

