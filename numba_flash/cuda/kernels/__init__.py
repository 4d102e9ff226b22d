"""The CUDA kernels, one file each, as cached factories that build a ``@cuda.jit`` kernel per tile config and
variant (tile sizes and head dim are compile-time constants):

    forward.py          SIMT forward (float32 shared-memory tiles, any dtype)
    backward_dkdv.py    SIMT backward: the delta pre-pass, dK/dV per key tile, the dbias sums
    backward_dq.py      SIMT backward: dQ per query tile (and attn_bias's gradient)
    tc_forward.py       tensor-core forward (mma.sync, float16/bfloat16, sm_80 on)
    tc_dkdv.py, tc_dq.py  tensor-core backward
    tf32_forward.py     TF32 tensor-core forward for float32 when the caller allows it
    decode.py           split-KV decoding over a dense or paged KV cache, and the merge of its splits
    merge.py            merge of two partial attentions by their lse

They are built from ``numba_flash.cuda.device`` helpers; ``numba_flash.cuda.host`` picks and launches them.
"""
