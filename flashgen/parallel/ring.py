"""Ring attention: the forward and backward loops, their autograd Function and the public calls.

Forward, per step s = 0 .. N-1 (rank r holds the K/V of rank (r - s) mod N):
  start shifting the K/V it holds to rank r+1 (and receiving the next from rank r-1), run the
  step's block (sharding.step_block) with the local attention, merge its (out, lse) into fp32
  accumulators, then wait for the shift.
Backward, per step: start the K/V shift for the next step, run the block's backward with the
merged out and lse, add its dQ into a local fp32 accumulator, wait for the dK/dV accumulator that
travels with these K/V (started by rank r-1 at the end of its previous step), add this block's
dK/dV to it and shift it on.  After the last step one more shift brings every rank the finished
dK/dV of its own K/V.
"""
from __future__ import annotations

import numbers
import typing

import torch

from . import sharding
from .comm import ProcessGroupRing, Ring, SimulatedRing
from .local import FlashgenLocalAttention, LocalAttention, TorchLocalAttention, VarlenArgs
from .sharding import ALL, FIRST


class _Rows(typing.NamedTuple):
    """Rows of a shard a block uses: a slice (dense, or every row) or an index tensor (the halves of
    a packed zigzag shard), with the cu_seqlens and max_seqlen of those rows (varlen only)."""
    index: typing.Union[slice, torch.Tensor]
    cu_seqlens: typing.Optional[torch.Tensor]
    max_seqlen: int


class _Geometry:
    """The rows of one rank's shard (the same on every rank: each holds 1/N of every sequence)."""

    def __init__(self, rows: int, cu_seqlens: torch.Tensor | None = None, max_seqlen: int = 0) -> None:
        self._rows = rows
        self._cu_seqlens = cu_seqlens
        self._max_seqlen = max_seqlen
        self._parts: dict[str, _Rows] = {}

    def rows(self, part: str) -> _Rows:
        if part not in self._parts:
            self._parts[part] = self._make(part)
        return self._parts[part]

    def _make(self, part: str) -> _Rows:
        if part == ALL:
            return _Rows(slice(None), self._cu_seqlens, self._max_seqlen)
        if self._cu_seqlens is None:
            half = self._rows // 2
            return _Rows(slice(0, half) if part == FIRST else slice(half, self._rows), None, half)
        index, cu_half = sharding.half_rows(self._cu_seqlens, part)
        return _Rows(index, cu_half, self._max_seqlen // 2)


def _row_dim(t: torch.Tensor, is_lse: bool) -> int:
    # q/k/v/out: (batch, rows, heads, d) or (total, heads, d); lse: (batch, heads, rows) or (heads, total).
    return t.dim() - 1 if is_lse else t.dim() - 3


def _take(t: torch.Tensor, rows: _Rows, is_lse: bool = False) -> torch.Tensor:
    dim = _row_dim(t, is_lse)
    if isinstance(rows.index, slice):
        return t[(slice(None),) * dim + (rows.index,)]
    return t.index_select(dim, rows.index)


def _add_rows(acc: torch.Tensor, rows: _Rows, value: torch.Tensor) -> None:
    dim = _row_dim(acc, False)
    if isinstance(rows.index, slice):
        acc[(slice(None),) * dim + (rows.index,)] += value
    else:
        acc.index_add_(dim, rows.index, value.to(acc.dtype))


def merge_partial(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge one block's (out, lse) over other keys into the accumulators, in place:
    lse' = log(e^lse_acc + e^lse), out' = e^(lse_acc - lse') out_acc + e^(lse - lse') out.
    out (..., rows, heads, d), lse (..., heads, rows); rows with lse -inf on both sides stay 0, -inf."""
    merged = torch.logaddexp(lse_acc, lse)
    reference = merged.masked_fill(torch.isneginf(merged), 0.0)  # keeps exp() of (-inf) - (-inf) at 0, not NaN

    def weight(x):  # (..., heads, rows) -> (..., rows, heads, 1)
        return torch.exp(x - reference).transpose(-1, -2).unsqueeze(-1)

    out_acc.mul_(weight(lse_acc)).add_(out.to(out_acc.dtype) * weight(lse.to(lse_acc.dtype)))
    lse_acc.copy_(merged)


def _merge_rows(out_acc, lse_acc, rows: _Rows, out, lse) -> None:
    # An in-place merge with torch ops rather than flash_attn_combine: combine wants all partials
    # stacked in one (splits, batch, seqlen, heads, d) fp32 tensor (N partial outputs kept, or a
    # copy per step), takes no half-shard row subset, and runs only on CUDA; this merge works on
    # views, on CPU too (the simulation tests), at one fused pass per step.
    if isinstance(rows.index, slice):
        merge_partial(_take(out_acc, rows), _take(lse_acc, rows, is_lse=True), out, lse)
        return
    out_rows, lse_rows = _take(out_acc, rows), _take(lse_acc, rows, is_lse=True)
    merge_partial(out_rows, lse_rows, out, lse)
    out_acc.index_copy_(_row_dim(out_acc, False), rows.index, out_rows)
    lse_acc.index_copy_(_row_dim(lse_acc, True), rows.index, lse_rows)


class _Setup(typing.NamedTuple):
    ring: Ring
    local: LocalAttention
    layout: str
    causal: bool
    softmax_scale: float
    geometry_q: _Geometry
    geometry_k: _Geometry

    def block(self, rank: int, step: int):
        """The step's block, with its query and key rows, or None when it sees no key."""
        source = (rank - step) % self.ring.world_size
        block = sharding.step_block(self.layout, self.ring.world_size, rank, source, self.causal)
        if block is None:
            return None
        return block, self.geometry_q.rows(block.q_part), self.geometry_k.rows(block.k_part)


def _varlen_args(rows_q: _Rows, rows_k: _Rows) -> VarlenArgs | None:
    if rows_q.cu_seqlens is None:
        return None
    return VarlenArgs(rows_q.cu_seqlens, rows_k.cu_seqlens, rows_q.max_seqlen, rows_k.max_seqlen)


def _lse_shape(q: torch.Tensor) -> tuple[int, ...]:
    return (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (q.shape[1], q.shape[0])


def _ring_forward(setup: _Setup, qs, ks, vs):
    ring, world_size = setup.ring, setup.ring.world_size
    acc_dtype = torch.promote_types(qs[0].dtype, torch.float32)
    outs = [torch.zeros(q.shape, dtype=acc_dtype, device=q.device) for q in qs]
    lses = [torch.full(_lse_shape(q), float("-inf"), dtype=acc_dtype, device=q.device) for q in qs]
    kv = [[k, v] for k, v in zip(ks, vs)]
    for step in range(world_size):
        # The next step's K/V travel while this step computes.
        pending = ring.shift(kv) if step + 1 < world_size else None
        for i, rank in enumerate(ring.hosted_ranks):
            planned = setup.block(rank, step)
            if planned is None:
                continue
            block, rows_q, rows_k = planned
            k, v = kv[i]
            out, lse = setup.local.forward(_take(qs[i], rows_q), _take(k, rows_k), _take(v, rows_k),
                                           causal=block.causal, softmax_scale=setup.softmax_scale,
                                           varlen=_varlen_args(rows_q, rows_k))
            _merge_rows(outs[i], lses[i], rows_q, out, lse)
        if pending is not None:
            kv = pending.wait()
    return [out.to(q.dtype) for out, q in zip(outs, qs)], lses


def _ring_backward(setup: _Setup, douts, qs, ks, vs, outs, lses):
    ring, world_size = setup.ring, setup.ring.world_size
    acc_dtype = torch.promote_types(qs[0].dtype, torch.float32)
    dqs = [torch.zeros(q.shape, dtype=acc_dtype, device=q.device) for q in qs]
    kv = [[k, v] for k, v in zip(ks, vs)]
    pending_dkv = None
    dkv = None
    for step in range(world_size):
        pending_kv = ring.shift(kv) if step + 1 < world_size else None
        contributions = []
        for i, rank in enumerate(ring.hosted_ranks):
            planned = setup.block(rank, step)
            if planned is None:
                contributions.append(None)
                continue
            block, rows_q, rows_k = planned
            k, v = kv[i]
            dq, dk, dv = setup.local.backward(
                _take(douts[i], rows_q), _take(qs[i], rows_q), _take(k, rows_k), _take(v, rows_k),
                _take(outs[i], rows_q), _take(lses[i], rows_q, is_lse=True), causal=block.causal,
                softmax_scale=setup.softmax_scale, varlen=_varlen_args(rows_q, rows_k))
            _add_rows(dqs[i], rows_q, dq)
            contributions.append((rows_k, dk, dv))
        # The dK/dV accumulators of these K/V arrive from rank - 1 while the block's backward runs.
        if pending_dkv is None:
            dkv = [[torch.zeros(k.shape, dtype=acc_dtype, device=k.device),
                    torch.zeros(v.shape, dtype=acc_dtype, device=v.device)] for k, v in kv]
        else:
            dkv = pending_dkv.wait()
        for (dk_acc, dv_acc), contribution in zip(dkv, contributions):
            if contribution is not None:
                rows_k, dk, dv = contribution
                _add_rows(dk_acc, rows_k, dk)
                _add_rows(dv_acc, rows_k, dv)
        if world_size > 1:  # after the last step this hop hands each rank its own finished dK/dV
            pending_dkv = ring.shift(dkv)
        if pending_kv is not None:
            kv = pending_kv.wait()
    if world_size > 1:
        dkv = pending_dkv.wait()
    dks = [dk.to(k.dtype) for (dk, _), k in zip(dkv, ks)]
    dvs = [dv.to(v.dtype) for (_, dv), v in zip(dkv, vs)]
    return [dq.to(q.dtype) for dq, q in zip(dqs, qs)], dks, dvs


class _RingAttention(torch.autograd.Function):
    """Inputs: the setup, then q, k, v of every hosted rank (all q first, then all k, all v);
    outputs: out of every hosted rank, then lse (not differentiable)."""

    @staticmethod
    def forward(ctx, setup: _Setup, *tensors):
        n = len(setup.ring.hosted_ranks)
        qs, ks, vs = tensors[:n], tensors[n:2 * n], tensors[2 * n:]
        outs, lses = _ring_forward(setup, qs, ks, vs)
        ctx.setup = setup
        ctx.save_for_backward(*qs, *ks, *vs, *outs, *lses)
        ctx.mark_non_differentiable(*lses)
        return (*outs, *lses)

    @staticmethod
    def backward(ctx, *grads):
        setup = ctx.setup
        n = len(setup.ring.hosted_ranks)
        saved = ctx.saved_tensors
        qs, ks, vs, outs, lses = (saved[i * n:(i + 1) * n] for i in range(5))
        # An unused output gets None; autograd may hand an expanded (stride 0) gradient.
        douts = [torch.zeros_like(out) if g is None else g.contiguous() for g, out in zip(grads[:n], outs)]
        dqs, dks, dvs = _ring_backward(setup, douts, qs, ks, vs, outs, lses)
        return (None, *dqs, *dks, *dvs)


@torch.compiler.disable
def _apply(setup: _Setup, qs, ks, vs):
    """Runs outside any torch.compile graph: dynamo would otherwise trace into the communication
    and the Python ring loop; the model around it still compiles, with a graph break here."""
    n = len(qs)
    results = _RingAttention.apply(setup, *qs, *ks, *vs)
    return list(results[:n]), list(results[n:])


# --- validation -------------------------------------------------------------------------------------

def _check_tensors(q, k, v, dims: int, shape_names: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name} must be {dims}-D {shape_names}; got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[:-3] != k.shape[:-3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch and head_dim")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"q's heads ({q.shape[-2]}) must be a multiple of k's ({k.shape[-2]})")


def _check_options(causal, softmax_scale, layout) -> None:
    if type(causal) is not bool:
        raise TypeError(f"causal must be a bool; got {causal!r}")
    if softmax_scale is not None and (not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool)):
        raise TypeError(f"softmax_scale must be a float or None; got {softmax_scale!r}")
    sharding.check_layout(layout)


def _check_dense_rows(q, k, layout, causal) -> None:
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal: q and k shards must have as many rows; got {q.shape[1]} and {k.shape[1]}")
    for name, t in (("q", q), ("k", k)):
        if layout == "zigzag" and t.shape[1] % 2:
            raise ValueError(f"{name}: a zigzag shard holds two equal chunks, so its rows must be even; "
                             f"got {t.shape[1]}")


def _check_varlen_shard(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k, layout, causal) -> None:
    for name, cu, t in (("cu_seqlens_q", cu_seqlens_q, q), ("cu_seqlens_k", cu_seqlens_k, k)):
        lengths = sharding._lengths(cu, name)
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}; got {cu.device}")
        if sum(lengths) != t.shape[0]:
            raise ValueError(f"{name} must end at the shard's rows ({t.shape[0]}); got {cu.tolist()}")
        if layout == "zigzag" and any(n % 2 for n in lengths):
            raise ValueError(f"{name}: a zigzag shard holds two equal chunks of every sequence, so every "
                             f"length must be even; got {lengths}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must count the same sequences; got "
                         f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    if causal and not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise ValueError("causal: cu_seqlens_q and cu_seqlens_k must be equal (self-attention shards)")
    for name, value, cu in (("max_seqlen_q", max_seqlen_q, cu_seqlens_q), ("max_seqlen_k", max_seqlen_k, cu_seqlens_k)):
        if type(value) is not int:
            raise TypeError(f"{name} must be an int; got {value!r}")
        longest = max(sharding._lengths(cu, name), default=0)
        if value < longest:
            raise ValueError(f"{name} ({value}) is below the longest shard sequence ({longest})")


def _scale(softmax_scale, q) -> float:
    return float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5


def _result(out, lse, return_attn_probs):
    return (out, lse, None) if return_attn_probs else out


# --- public calls -----------------------------------------------------------------------------------

def ring_flash_attn_func(q, k, v, *, group=None, causal=False, softmax_scale=None, layout="zigzag",
                         deterministic=False, return_attn_probs=False, local_attention=None):
    """Attention over a sequence sharded along dim 1 over the ranks of ``group`` (torch.distributed,
    NCCL for flashgen's kernels).

    q (batch, rows, nheads, d), k/v (batch, rows, nheads_k, d): this rank's shard in ``layout``
    ("zigzag": chunks r and 2N-1-r of 2N; "contiguous": chunk r of N; flashgen.parallel.shard
    makes them).  Returns this rank's ``out``, or ``(out, softmax_lse, None)`` with softmax_lse
    float32 (batch, nheads, rows), both in the shard's row order.  ``local_attention`` replaces
    flashgen's kernels (flashgen.parallel.local).
    """
    _check_tensors(q, k, v, 4, "(batch, rows, heads, head_dim)")
    _check_options(causal, softmax_scale, layout)
    _check_dense_rows(q, k, layout, causal)
    local = local_attention or FlashgenLocalAttention(deterministic)
    setup = _Setup(ProcessGroupRing(group), local, layout, causal, _scale(softmax_scale, q),
                   _Geometry(q.shape[1]), _Geometry(k.shape[1]))
    (out,), (lse,) = _apply(setup, [q], [k], [v])
    return _result(out, lse, return_attn_probs)


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, group=None,
                                causal=False, softmax_scale=None, layout="zigzag", deterministic=False,
                                return_attn_probs=False, local_attention=None):
    """ring_flash_attn_func for a packed batch: every rank holds its part (in ``layout``) of every
    sequence, packed; q (total_q, nheads, d), k/v (total_k, nheads_k, d) are this rank's rows and
    cu_seqlens_q/k (int32, batch + 1) and max_seqlen_q/k describe the shard
    (flashgen.parallel.shard_cu_seqlens / shard_varlen make them).  softmax_lse: (nheads, total_q).
    The cu_seqlens are read on the host once per call (a device sync when they live on the GPU).
    """
    _check_tensors(q, k, v, 3, "(total, heads, head_dim)")
    _check_options(causal, softmax_scale, layout)
    _check_varlen_shard(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k, layout, causal)
    local = local_attention or FlashgenLocalAttention(deterministic)
    setup = _Setup(ProcessGroupRing(group), local, layout, causal, _scale(softmax_scale, q),
                   _Geometry(q.shape[0], cu_seqlens_q, max_seqlen_q), _Geometry(k.shape[0], cu_seqlens_k, max_seqlen_k))
    (out,), (lse,) = _apply(setup, [q], [k], [v])
    return _result(out, lse, return_attn_probs)


def simulate_ring_attention(q, k, v, world_size, *, causal=False, softmax_scale=None, layout="zigzag",
                            cu_seqlens_q=None, cu_seqlens_k=None, deterministic=False, local_attention=None):
    """The ring of ``world_size`` ranks run in this process on full-sequence inputs: the inputs are
    sharded, every rank's loop runs with communication replaced by list rotation (the same chunking,
    merge and backward code as ring_flash_attn_func), and the shards are put back together.

    Dense q (batch, seqlen, nheads, d), or packed q (total, nheads, d) with the full batch's
    cu_seqlens_q/k.  Returns ``(out, softmax_lse)`` for the full sequence (lse (batch, nheads,
    seqlen) or (nheads, total)); differentiable in q, k, v.  ``local_attention`` defaults to
    flashgen's kernels; flashgen.parallel.TorchLocalAttention runs it on the CPU.
    """
    sharding.check_world_size(world_size)
    _check_options(causal, softmax_scale, layout)
    local = local_attention or FlashgenLocalAttention(deterministic)
    ring = SimulatedRing(world_size)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if not varlen:
        _check_tensors(q, k, v, 4, "(batch, seqlen, heads, head_dim)")
        qs, ks, vs = ([sharding.shard(t, world_size, r, layout, dim=1) for r in ring.hosted_ranks] for t in (q, k, v))
        _check_dense_rows(qs[0], ks[0], layout, causal)
        setup = _Setup(ring, local, layout, causal, _scale(softmax_scale, q),
                       _Geometry(qs[0].shape[1]), _Geometry(ks[0].shape[1]))
        outs, lses = _apply(setup, qs, ks, vs)
        return sharding.unshard(outs, layout, dim=1), sharding.unshard(lses, layout, dim=-1)
    _check_tensors(q, k, v, 3, "(total, heads, head_dim)")
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("cu_seqlens_q and cu_seqlens_k: pass both for a packed batch, or neither")
    local_cu = [sharding.shard_cu_seqlens(cu, world_size, layout) for cu in (cu_seqlens_q, cu_seqlens_k)]
    qs = [sharding.shard_varlen(q, cu_seqlens_q, world_size, r, layout) for r in ring.hosted_ranks]
    ks, vs = ([sharding.shard_varlen(t, cu_seqlens_k, world_size, r, layout) for r in ring.hosted_ranks] for t in (k, v))
    max_local = [max(sharding._lengths(cu, "cu_seqlens"), default=0) for cu in local_cu]
    _check_varlen_shard(*local_cu, *max_local, qs[0], ks[0], layout, causal)
    setup = _Setup(ring, local, layout, causal, _scale(softmax_scale, q),
                   _Geometry(qs[0].shape[0], local_cu[0], max_local[0]),
                   _Geometry(ks[0].shape[0], local_cu[1], max_local[1]))
    outs, lses = _apply(setup, qs, ks, vs)
    return (sharding.unshard_varlen(outs, cu_seqlens_q, layout, dim=0),
            sharding.unshard_varlen(lses, cu_seqlens_q, layout, dim=-1))


__all__ = ["ring_flash_attn_func", "ring_flash_attn_varlen_func", "simulate_ring_attention", "merge_partial",
           "TorchLocalAttention"]
