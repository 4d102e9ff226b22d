"""Context-parallel (ring) attention over ``torch.distributed``: each rank holds a slice of the sequence.

    import torch.distributed as dist
    from numba_flash.distributed import ring_attention, shard_sequence, gather_sequence

    dist.init_process_group("gloo")            # "nccl" on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v = (shard_sequence(x, rank, world, causal=True) for x in (q_full, k_full, v_full))
    out = ring_attention(q, k, v, causal=True)             # (B, S / world, H, D), this rank's rows
    out_full = gather_sequence(out, causal=True)           # (B, S, H, D) on every rank

Each step, every rank computes attention of its queries against the K/V block it holds with the registry's
``flash`` op, merges the partial result into its running one by log-sum-exp (``merge_attention_states``), and passes
the block on to the next rank (rank r sends to r + 1, receives from r - 1), the transfer of the next block running
while the current one is computed. After ``world`` steps every query has seen every key exactly once.

The backward recomputes each block with the registry's ``backward`` from the global out and lse, which gives that
block's exact share of the gradients. dq accumulates where it is; dk and dv accumulate in float32 buffers that travel
around the ring with their K/V block and arrive home after the last step.

Causal load balance: with contiguous slices, rank 0 would see one block of keys and the last rank all of them. The
sequence is instead cut into ``2 * world`` chunks and rank r holds chunks r and ``2 * world - 1 - r`` (the zigzag
layout; ``shard_sequence`` makes it), so every step costs every rank the same: half its queries against all the
block, or all its queries against half of it.

Only torch is needed (imported with this module); ``import numba_flash`` does not import this module.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from numba_flash.arguments import checked_arguments
from numba_flash.errors import AttentionInputError, UnknownKeywordError, bad_arg, short_repr
from numba_flash import backend_registry
from numba_flash.merge import merge_attention_states
from numba_flash.validation import validate_forward

__all__ = ["ring_attention", "RingAttentionFunc", "shard_sequence", "unshard_sequence", "gather_sequence"]


# ---------------------------------------------------------------------------------------------------------------
# Sharding


def _chunks(length: int, world_size: int, causal: bool, arg: str, dim: int) -> int:
    """The length of one chunk: S / (2 W) for causal (zigzag), S / W otherwise; AttentionInputError if uneven."""
    parts = 2 * world_size if causal else world_size
    if length % parts:
        layout = f"2 * world_size = {parts} zigzag chunks (causal)" if causal else f"world_size = {parts} slices"
        raise bad_arg(arg, f"a length along dim {dim} divisible into {layout}", f"length {length}")
    return length // parts


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, causal: bool = False, dim: int = 1) -> torch.Tensor:
    """The part of a full sequence that rank ``rank`` holds in ``ring_attention``.

    Arguments:
        x: any shape, the sequence along ``dim`` (q, k, v, dout: (B, S, H, D) with dim=1; an lse (B, H, S): dim=2);
            any dtype and device. Never modified.
        rank, world_size: ints, 0 <= rank < world_size.
        causal: False: the contiguous slice ``rank * S / W : (rank + 1) * S / W``. True: the zigzag layout, chunks
            ``rank`` and ``2 W - 1 - rank`` of ``2 W`` equal chunks, one after the other.
    Returns:
        A new tensor, x's dtype and device, shaped like x with S / W along ``dim``.
    """
    if not isinstance(x, torch.Tensor):
        raise bad_arg("x", "a torch.Tensor", type(x).__name__)
    if not (isinstance(world_size, int) and world_size >= 1):
        raise bad_arg("world_size", "an int >= 1", short_repr(world_size))
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise bad_arg("rank", f"an int in [0, {world_size})", short_repr(rank))
    if not (isinstance(dim, int) and -x.dim() <= dim < x.dim()):
        raise bad_arg("dim", f"a dimension of x (shape {tuple(x.shape)})", short_repr(dim))
    c = _chunks(x.shape[dim], world_size, causal, "x", dim)
    if not causal:
        return x.narrow(dim, rank * c, c).clone()
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, (2 * world_size - 1 - rank) * c, c)], dim=dim)


def unshard_sequence(parts: Sequence[torch.Tensor], causal: bool = False, dim: int = 1) -> torch.Tensor:
    """Put the full sequence back together from every rank's part (``parts[r]`` from rank r), the inverse of
    ``shard_sequence``. Parts: one shape, dtype and device; the result has W times their length along ``dim``."""
    parts = list(parts) if isinstance(parts, (list, tuple)) else parts
    if not isinstance(parts, list) or not parts or not all(isinstance(p, torch.Tensor) for p in parts):
        raise bad_arg("parts", "a non-empty list of torch tensors, one per rank", short_repr(parts))
    shape = tuple(parts[0].shape)
    for r, p in enumerate(parts):
        if tuple(p.shape) != shape:
            raise bad_arg(f"parts[{r}]", f"the shape of parts[0] {shape}", f"shape {tuple(p.shape)}")
    if not causal:
        return torch.cat(parts, dim=dim)
    c = _chunks(shape[dim], 1, True, "parts[0]", dim)
    firsts = [p.narrow(dim, 0, c) for p in parts]
    seconds = [p.narrow(dim, c, c) for p in reversed(parts)]   # rank W-1 holds chunk W, rank 0 chunk 2W-1
    return torch.cat(firsts + seconds, dim=dim)


def gather_sequence(x: torch.Tensor, *, group: Any = None, causal: bool = False, dim: int = 1) -> torch.Tensor:
    """Every rank's part of a sequence (``shard_sequence``'s layout), gathered into the full sequence on every rank
    of ``group`` with ``all_gather``. x: this rank's part, same shape on every rank. Not differentiable."""
    _check_group(group)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard_sequence(parts, causal=causal, dim=dim)


# ---------------------------------------------------------------------------------------------------------------
# The ring


def _check_group(group: Any) -> None:
    if not dist.is_available():
        raise bad_arg("group", "torch.distributed to be available", "a torch built without it")
    if not dist.is_initialized():
        raise bad_arg("group", "an initialised process group (call torch.distributed.init_process_group first)",
                      "no process group initialised")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise bad_arg("group", "a torch.distributed ProcessGroup or None (the default group)", short_repr(group))
    if dist.get_rank(group) < 0:
        # a rank outside the group gets -1 from get_rank and would address peers that are not its neighbours
        raise bad_arg("group", f"a group this rank ({dist.get_rank()}) belongs to", "a group without it")


class _Ring:
    """This rank's place in the ring and the two peers it talks to, as global ranks (what P2POp takes)."""

    def __init__(self, group: Any):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next, self.prev = to_global((self.rank + 1) % self.size), to_global((self.rank - 1) % self.size)

    def exchange(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Start sending ``send`` to the next rank and receiving a tensor like it from the previous one; returns
        the receive buffer and the requests to wait on before reading it (or writing ``send``)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)

    def source(self, step: int) -> int:
        """The rank whose K/V block this rank holds at ``step``."""
        return (self.rank - step) % self.size


def _wait(requests: list) -> None:
    for req in requests:
        req.wait()


def _block_plan(ring: _Ring, step: int, causal: bool, half: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal mask) of the block computed at ``step``; see the module docstring.

    Zigzag: this rank holds query chunks r < 2W-1-r; the K/V block from rank s holds chunks s < 2W-1-s. Step 0
    (s = r) is the local causal block: positions increase along the local sequence, so one causal call covers the
    four chunk pairs. For s < r, chunk s precedes both query chunks and chunk 2W-1-s follows both: all queries
    against the first half of the block. For s > r, both key chunks follow chunk r and precede chunk 2W-1-r: the
    second half of the queries against the whole block."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    src = ring.source(step)
    if src == ring.rank:
        return everything, everything, True
    if src < ring.rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


def _rows(x: torch.Tensor, rows: slice, dim: int = 1) -> torch.Tensor:
    return x if rows == slice(None) else x[(slice(None),) * dim + (rows,)]


class RingAttentionFunc(torch.autograd.Function):
    """Autograd glue of ``ring_attention``. Returns ``(out, lse)``; lse has no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, softmax_scale, softcap, backend):
        ring = _Ring(group)
        op = backend_registry.get("flash")
        opts = dict(softmax_scale=softmax_scale, softcap=softcap, backend=backend)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        half = q.shape[1] // 2
        # K and V travel as one tensor: one message per step, and the two cannot be matched out of order.
        kv = torch.stack([k, v])
        out = lse = None
        for step in range(ring.size):
            if step + 1 < ring.size:
                kv_next, pending = ring.exchange(kv, tag=0)
            rows, keys, mask = _block_plan(ring, step, causal, half)
            o, l = op.forward(_rows(q, rows), _rows(kv[0], keys), _rows(kv[1], keys), causal=mask,
                              return_lse=True, **opts)
            o, l = o.to(acc), l.to(acc)
            if out is None:                       # step 0 always covers every query row
                out, lse = o, l
            elif rows == slice(None):
                out, lse = merge_attention_states(out, lse, o, l)
            else:
                # out and lse are this function's own buffers (fresh outputs of the op or of a merge), so the
                # rows the block covers are overwritten in place rather than the whole tensors rebuilt.
                merged_o, merged_l = merge_attention_states(_rows(out, rows), _rows(lse, rows, 2), o, l)
                _rows(out, rows).copy_(merged_o)
                _rows(lse, rows, 2).copy_(merged_l)
            if step + 1 < ring.size:
                _wait(pending)
                kv = kv_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.params = (group, causal, opts)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, opts = ctx.params
        ring = _Ring(group)
        op = backend_registry.get("flash")
        dout = dout.contiguous().to(q.dtype)
        half = q.shape[1] // 2
        dq = torch.zeros(q.shape, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype, device=q.device)
        kv = torch.stack([k, v])
        dkv_incoming = dkv_pending = None
        for step in range(ring.size):
            if step + 1 < ring.size:
                kv_next, kv_pending = ring.exchange(kv, tag=0)
            rows, keys, mask = _block_plan(ring, step, causal, half)
            # The global out and lse make each block's probabilities and row sums (delta) those of the whole
            # softmax, so the block's gradients are its exact share.
            dq_b, dk_b, dv_b = op.backward(_rows(dout, rows), _rows(q, rows), _rows(kv[0], keys),
                                           _rows(kv[1], keys), _rows(out, rows), _rows(lse, rows, 2),
                                           causal=mask, **opts)
            _rows(dq, rows).add_(dq_b)
            if dkv_pending is None:
                dkv = torch.zeros(kv.shape, dtype=dq.dtype, device=kv.device)
            else:
                _wait(dkv_pending)
                dkv = dkv_incoming
            _rows(dkv[0], keys).add_(dk_b)
            _rows(dkv[1], keys).add_(dv_b)
            if ring.size > 1:
                # After the last step this sends each block's gradient home: the block held at step W-1 came
                # from rank r + 1, the next rank.
                dkv_incoming, dkv_pending = ring.exchange(dkv, tag=1)
            else:
                dkv_incoming = dkv
            if step + 1 < ring.size:
                _wait(kv_pending)
                kv = kv_next
        if dkv_pending is not None:
            _wait(dkv_pending)
        dk, dv = dkv_incoming[0].to(k.dtype), dkv_incoming[1].to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# The public function


MESSAGE_BYTES = 1024  # of a rank's refusal, sent to every rank: enough for any AttentionInputError of the checks
#: The errors a rank's refusal is raised as on every rank, most specific first (its index + 1 travels with it);
#: any other exception is raised as RuntimeError, its type named in the message.
_REFUSALS = (UnknownKeywordError, AttentionInputError, TypeError, ValueError, RuntimeError)


def _refusal_code(refusal: BaseException) -> tuple[int, str]:
    """(the index + 1 in _REFUSALS of the class every rank raises for ``refusal``, the message it carries)."""
    for i, kind in enumerate(_REFUSALS):
        if isinstance(refusal, kind) and kind is not RuntimeError:
            return i + 1, str(refusal)
    return len(_REFUSALS), f"{type(refusal).__name__}: {refusal}"


def _check_ranks_agree(q: Any, k: Any, group: Any, causal: bool, refusal: BaseException | None = None) -> None:
    """Every rank must pass valid input and the same shapes, dtype and options: the receive buffers are allocated
    from this rank's own shapes, and a mismatch would hang or mix garbage in. One small all_gather carries each
    rank's verdict on its own input (``refusal``: the error its checks raised, or None: then q and k are its
    tensors) and what the ranks must agree on, so that every rank raises the same error (of the same class, see
    ``_REFUSALS``) and none is left waiting in a collective (until the group's timeout) for a rank that has
    already raised."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    if refusal is None:
        meta = [0, *q.shape, *k.shape, dtypes.index(q.dtype), int(causal)]
        text = b""
    else:  # this rank's shapes may not even exist: it sends its error instead
        code, message = _refusal_code(refusal)
        meta = [code] + [0] * 10
        text = message.encode()[:MESSAGE_BYTES]
    if dist.get_backend(group) == "nccl":
        device = q.device if isinstance(q, torch.Tensor) and q.is_cuda else torch.device("cuda",
                                                                                          torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mine = torch.tensor(meta + list(text) + [0] * (MESSAGE_BYTES - len(text)), dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    every = [theirs.tolist() for theirs in every]
    for r, theirs in enumerate(every):
        if theirs[0]:   # the first rank that refused its input: its error, on every rank
            message = bytes(c for c in theirs[11:] if c).decode(errors="replace")
            kind = _REFUSALS[min(max(theirs[0], 1), len(_REFUSALS)) - 1]
            raise kind(f"{message} (on rank {r} of {len(every)}; every rank raises this)") from refusal
    meta = meta[1:]
    for r, theirs in enumerate(every):
        theirs = theirs[1:11]
        if theirs != meta:
            what = (f"q {tuple(theirs[:4])}, k and v {tuple(theirs[4:8])}, {dtypes[theirs[8]]}, "
                    f"causal={bool(theirs[9])}")
            raise bad_arg("q, k, v", f"the same shapes, dtype and causal flag on every rank (this rank, "
                          f"{dist.get_rank(group)}: q {tuple(q.shape)}, k and v {tuple(k.shape)}, {q.dtype}, "
                          f"causal={causal})", f"on rank {r}: {what}")


def _check_local(q: Any, k: Any, v: Any, causal: bool, softmax_scale: Any, window_size: Any, softcap: Any,
                 return_lse: bool) -> None:
    """ring_attention's checks of this rank's own input, which need no communication."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise bad_arg(name, "a torch.Tensor (ring_attention works on torch.distributed)", type(x).__name__)
    if not isinstance(window_size, (tuple, list)) or tuple(window_size) != (-1, -1):
        raise bad_arg("window_size", "(-1, -1) (a sliding window is not supported by ring_attention)",
                      short_repr(window_size))
    validate_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, softcap=softcap, layout="bshd",
                     return_lse=return_lse)
    if v.shape[-1] != q.shape[-1]:
        raise bad_arg("v", f"q's head dim {q.shape[-1]} (ring_attention does not take a different Dv yet)",
                      f"head dim {v.shape[-1]}")
    if causal:
        if k.shape[1] != q.shape[1]:
            raise bad_arg("k", f"the local sequence length of q ({q.shape[1]}) for causal ring attention "
                          "(self-attention in the zigzag layout)", f"length {k.shape[1]}")
        if q.shape[1] % 2:
            raise bad_arg("q", "an even local sequence length for causal ring attention (two zigzag chunks, see "
                          "shard_sequence)", f"length {q.shape[1]}")


def _ring_arguments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    backend: Optional[str] = None,
) -> dict[str, Any]:
    """ring_attention's arguments by name: the signature ``ring_attention`` shows and binds its call to."""
    return dict(q=q, k=k, v=v, group=group, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                softcap=softcap, return_lse=return_lse, backend=backend)


_ring_arguments.__qualname__ = "ring_attention"   # checked_arguments and Python's TypeError name the function so
_bind = checked_arguments(_ring_arguments)


def _verdict(args: Any, kwargs: Any) -> tuple[dict[str, Any] | None, BaseException | None, Any]:
    """(the call's arguments by name or None, this rank's refusal or None, the group to exchange verdicts on). A
    refusal is any error of the checks that need no communication: ``checked_arguments``' (an unknown keyword, a
    MaskedTensor), Python's binding (a missing argument), the local checks (of any class); each goes through the
    exchange. Raised here, alone, only where no rank can be told: no process group, or a group without this rank."""
    try:
        a = _bind(*args, **kwargs)
        refusal = None
    except Exception as exc:   # noqa: BLE001  every rank raises it, of its class, after the exchange
        a, refusal = None, exc
    if a is not None:
        try:
            _check_local(a["q"], a["k"], a["v"], a["causal"], a["softmax_scale"], a["window_size"], a["softcap"],
                         a["return_lse"])
        except Exception as exc:   # noqa: BLE001  likewise (a TypeError of a malformed option too)
            refusal = exc
    group = a["group"] if a is not None else kwargs.get("group")
    try:
        _check_group(group)
    except AttentionInputError as exc:
        reachable = dist.is_available() and dist.is_initialized() and not isinstance(group, dist.ProcessGroup)
        if not reachable:   # no group to tell: this rank's own error comes first
            raise (refusal or exc) from None
        # Not a group at all: the other ranks, calling with group=None, wait in the default group's exchange.
        refusal, group = refusal or exc, None
    return a, refusal, group


def ring_attention(*args: Any, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence split across the ranks of ``group``, differentiable.

    Every rank of the group calls it at once with its own part of the sequence (``shard_sequence`` makes the
    parts: contiguous slices, or the zigzag layout for causal). The result on each rank is attention of its query
    rows over the keys of every rank, equal to ``flash_attn_func`` on the full sequence cut the same way. Causal is
    self-attention over the global sequence: global query i sees global key j iff j <= i.

    Arguments:
        q: (B, S_local, Hq, D) ("bshd"), float16, bfloat16, float32 or float64; this rank's queries. Never modified.
        k, v: (B, S_local_k, Hkv, D), Hq % Hkv == 0; q's dtype and device. With causal, S_local_k == S_local and
            S_local is even (two zigzag chunks).
        group: a ``torch.distributed`` process group (None: the default one, which must be initialised). Same
            shapes, dtype and options on every rank; gloo for CPU tensors, NCCL for CUDA ones.
        causal: bool. Causal self-attention over the global sequence, inputs in the zigzag layout.
        softmax_scale: float > 0, default 1 / sqrt(D). softcap: float >= 0, as in ``flash_attn_func``.
        window_size: only (-1, -1): a sliding window is not supported by ring attention here.
        return_lse: also return the log-sum-exp of each query row over all keys.
        backend: the registry backend that computes each block (None: the registry chooses).

    Returns:
        out: (B, S_local, Hq, D), q's dtype and device: this rank's rows of the attention output.
        lse [only if return_lse]: (B, Hq, S_local) float32 (float64 for float64 inputs). Not differentiable.

    Gradients flow to q, k and v (dk, dv of this rank's keys, summed over every rank's queries), accumulated in
    float32 (float64 for float64 inputs). Raises ``numba_flash.AttentionInputError`` naming the argument for bad
    input, the same error on every rank when the ranks disagree on shapes, dtype or causal. A rank whose own call
    is refused (a bad argument, an unknown keyword, a missing one, a ``group`` that is not a group) sends its error
    to the others first: every rank then raises it, of its class, naming the rank, and none waits alone.
    """
    a, refusal, group = _verdict(args, kwargs)
    q, k = (a["q"], a["k"]) if a is not None else (None, None)
    # Never raise alone before this exchange: the other ranks would wait for this one in it.
    _check_ranks_agree(q, k, group, bool(a["causal"]) if a is not None else False, refusal)
    backend = a["backend"]
    if backend is None:
        # A backend forced with backend_registry.use() lives in this thread's context; autograd may run the
        # backward on another thread, so name it now.
        backend = backend_registry.get("flash").forced_backend()
    scale = None if a["softmax_scale"] is None else float(a["softmax_scale"])
    out, lse = RingAttentionFunc.apply(q, k, a["v"], group, bool(a["causal"]), scale, float(a["softcap"]), backend)
    return (out, lse) if a["return_lse"] else out


ring_attention.__signature__ = inspect.signature(_ring_arguments).replace(  # type: ignore[attr-defined]
    return_annotation="torch.Tensor | tuple[torch.Tensor, torch.Tensor]")
