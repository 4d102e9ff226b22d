"""numba-flash: exact FlashAttention (tiled, online softmax, no S x S matrix) written as Numba kernels.

    from numba_flash import backend_registry       # also importable as backends.backend_registry
    out = backend_registry.get("flash").forward(q, k, v, causal=True)

    import numba_flash
    o = numba_flash.flash_attn_func(q, k, v, causal=True)   # torch tensors, autograd-aware
    o = numba_flash.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k)   # packed sequences
    o = numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)  # decode step
    out, lse = numba_flash.merge_attention_states(out_a, lse_a, out_b, lse_b)   # two key sets' partial results
    numba_flash.check_mods_on_host(q, k, mask_mod=fn)   # a mod run on the host everywhere, before a GPU runs it
    keep = numba_flash.dropout_mask(seed, B, Hq, Sq, Sk, dropout_p)   # the dropout mask every backend applies
    o = numba_flash.ring_attention(q, k, v, causal=True)   # sequence split over torch.distributed ranks

Importing this package needs only numpy and numba; torch and numba.cuda are imported where they are used.
"""

from __future__ import annotations

from typing import Any

from . import mods as _mods
from .arguments import checked_arguments
from .errors import AttentionInputError, NoBackendError
from .merge import merge_attention_states
from .mod_check import check_mods_on_host
from .mods import BlockMask
from .reference import (attention_ref, attention_ref_backward, attention_ref_kvcache, attention_ref_varlen,
                        attention_ref_varlen_backward)
from .validation import AttentionCall, validate_backward, validate_forward

__version__ = "0.1.0"

# Wrapped here, not where they are defined: the CUDA kernels compile code from mods.py and dropout.py, whose every
# edit invalidates the recorded compile table (numba_flash/cuda/compile_check/table.py).
block_mask = checked_arguments(_mods.block_mask)
_dropout_mask = None

__all__ = [
    "AttentionInputError",
    "NoBackendError",
    "AttentionCall",
    "attention_ref",
    "attention_ref_backward",
    "attention_ref_kvcache",
    "attention_ref_varlen",
    "attention_ref_varlen_backward",
    "merge_attention_states",
    "block_mask",
    "BlockMask",
    "check_mods_on_host",
    "validate_forward",
    "validate_backward",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "ring_attention",
    "dropout_mask",
    "backend_registry",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # flash_attn_func and flash_attn_varlen_func need torch; import them only when somebody asks for them.
    if name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"):
        from . import torch_api

        # kept as the module's own attribute: a decode loop that calls numba_flash.flash_attn_with_kvcache would
        # pay this lookup (a microsecond) every step
        globals()[name] = face = getattr(torch_api, name)
        return face
    if name == "ring_attention":   # numba_flash.distributed, which imports torch.distributed
        from . import distributed

        return distributed.ring_attention
    if name == "dropout_mask":   # numba_flash.dropout compiles nothing until called, but defines numba functions
        global _dropout_mask
        if _dropout_mask is None:
            from .dropout import dropout_mask

            _dropout_mask = checked_arguments(dropout_mask)
        return _dropout_mask
    if name == "backend_registry":
        import importlib  # not `from . import`: that would look the attribute up here again, endlessly

        return importlib.import_module(".backend_registry", __name__)
    raise AttributeError(f"module 'numba_flash' has no attribute {name!r}")
