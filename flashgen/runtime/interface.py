"""The public forward API, a drop-in for flash_attn 2.x's ``flash_attn_func`` family."""
from __future__ import annotations

import functools
import typing

import torch

from .. import config
from ..generator import matrix
from ..generator import params as params_mod
from ..generator.spec import KernelSpec
from . import tma, validate
from .device import device_index, device_info
from .dispatch import FwdPlan, plan_fwd
from .launch import get_kernel


def _whole_chunks(t: torch.Tensor) -> bool:
    """Whether kernels can move t's rows in 16-byte chunks: a contiguous last dim, a 16-byte
    aligned base and strides of whole 8-element chunks."""
    strides = t.stride()  # (on every call: one tuple, no generator)
    if strides[-1] != 1 or t.data_ptr() % 16:
        return False
    for stride in strides[:-1]:
        if stride % 8:
            return False
    return True


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy in whole 16-byte chunks (_whole_chunks). Inputs are validated to have a
    contiguous last dim; dout arrives in whatever layout autograd made (expanded from a sum,
    interleaved from a stack, ...)."""
    return t if _whole_chunks(t) else t.contiguous()


# The kernels move rows in whole 16-byte chunks (8 fp16/bf16 elements). As in flash_attn 2, a call
# whose head dim is not a multiple of 8 runs on copies padded with zero columns, which change no
# score and give zero output columns, and its outputs are sliced back; autograd carries the
# gradients through the pad and the slice. A head dim that is a multiple of 8 skips all of it.
HEAD_DIM_MULTIPLE = 8


def pad_head_dim(x: torch.Tensor, multiple: int = HEAD_DIM_MULTIPLE) -> torch.Tensor:
    """x with zero columns appended to its last dimension up to a multiple of ``multiple``; x itself
    when it is one."""
    extra = -x.shape[-1] % multiple
    return torch.nn.functional.pad(x, (0, extra)) if extra else x


_LOG2E = 1.4426950408889634


def dropout_threshold_and_scale(dropout_p: float) -> tuple[int, float]:
    """(threshold, scale) for dropout_p: a probability is kept iff its random byte is below the
    threshold, round((1 - p) * 256), so with probability threshold / 256, and kept ones are scaled
    by 256 / threshold. The expected output is then exactly the undropped one; 1 / (1 - p) would be
    off by up to 0.2% (p = 0.1 keeps 230 / 256 = 0.8984)."""
    if dropout_p <= 0.0:
        return 256, 1.0
    threshold = min(256, max(0, round((1.0 - dropout_p) * 256)))
    return threshold, (256.0 / threshold if threshold else 0.0)


class DropoutState(typing.NamedTuple):
    """A call's dropout: probability and the Philox (seed, offset) it draws with."""

    p: float
    seed: int
    offset: int

    def params(self) -> dict:
        threshold, scale = dropout_threshold_and_scale(self.p)
        return dict(philox_seed=self.seed, philox_offset=self.offset, dropout_threshold=threshold,
                    rp_dropout=scale)

    def rng_state(self) -> torch.Tensor:
        return torch.tensor([self.seed, self.offset], dtype=torch.int64)


NO_DROPOUT = DropoutState(0.0, 0, 0)
NO_DROPOUT_PARAMS = NO_DROPOUT.params()  # packed by every forward without dropout: computed once
# Philox offsets one call reserves from PyTorch's generator (its unit: 4 values per thread).
PHILOX_OFFSET_STEP = 4


def draw_dropout(dropout_p: float, device_index_: int) -> DropoutState:
    """Take (seed, offset) from the device's default CUDA generator and advance its offset, as
    flash_attn does: torch.manual_seed makes the masks reproducible."""
    if dropout_p <= 0.0:
        return NO_DROPOUT
    generator = torch.cuda.default_generators[device_index_]
    seed = generator.initial_seed()
    offset = generator.get_offset()
    generator.set_offset(offset + PHILOX_OFFSET_STEP)
    if seed >= 2**63:  # the params field is a signed 64-bit integer: keep the bits
        seed -= 2**64
    return DropoutState(float(dropout_p), seed, offset)


def dropout_from_rng_state(dropout_p: float, rng_state: torch.Tensor) -> DropoutState:
    if dropout_p <= 0.0:
        return NO_DROPOUT
    seed, offset = rng_state.tolist()
    return DropoutState(float(dropout_p), seed, offset)


_COMBINE_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _launch(spec, smem_bytes: int, num_threads: int, grid, params: bytes, index: int,
            dependent: bool = False, cluster: tuple[int, int, int] | None = None) -> None:
    """Launch on the current stream; ``dependent``: as a programmatic dependent launch (see
    LoadedKernel.launch_dependent; the kernel must wait with griddepcontrol.wait); ``cluster``: in
    thread-block clusters of that shape (sm_90+)."""
    kernel = get_kernel(spec, smem_bytes, num_threads)
    launch = kernel.launch_dependent if dependent else kernel.launch
    if cluster is not None:
        launch = functools.partial(kernel.launch_cluster, cluster=cluster, dependent=dependent)
    if torch.cuda.current_device() != index:
        with torch.cuda.device(index):
            kernel.prepare(index)
            launch(grid, _stream_handle(index), params)
    else:
        kernel.prepare(index)
        launch(grid, _stream_handle(index), params)


# The current stream's handle, without building a torch.cuda.Stream object (a few microseconds per
# launch): the raw getter CUDA builds of torch have, else the public API.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_handle(index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


# The split-KV combine as a programmatic dependent launch on sm_90+ (launch_combine). A switch for
# benchmarks/tune_decode.py, which measures both ways.
DEPENDENT_COMBINE = True


@functools.lru_cache(maxsize=64)
def _combine_spec(capability: tuple[int, int], dtype: torch.dtype) -> KernelSpec:
    arch = matrix.target_arch(*capability)
    return KernelSpec("combine", matrix.family_for(arch), arch, _COMBINE_DTYPES[dtype])


@functools.lru_cache(maxsize=256)
def _combine_geometry(num_splits: int, rows: int, head_dim: int, num_sms: int):
    """(threads, grid) of a combine launch. templates/combine.cuh derives the rest from the grid;
    any grid is correct. A CTA of `threads` (kCombineThreads) is R rows x G split groups x C column
    threads; the grid sets R, and with it G = threads / (R * C). Each thread has up to 8 partial
    float4s in flight per batch (kCombineLoads): up to 8 splits (its group's share) of one chunk
    when num_splits > 4, else 8 / 2**ceil(log2(splits)) chunks of every split. Pick R so that one
    batch covers the splits (G >= splits / 8), and, when rows are few, so that they spread over the
    SMs: at decode every row then gets a whole CTA and the combine costs about one global round
    trip."""
    threads = 256  # kCombineThreads
    chunks_per_thread = 1 if num_splits > 4 else 8 >> (num_splits - 1).bit_length()  # kKc
    col_threads = min(1 << max(-(-(head_dim // 4) // chunks_per_thread) - 1, 0).bit_length(), 64)  # C
    rows_per_pass = threads // col_threads
    if chunks_per_thread == 1:
        rows_per_pass = max(1, rows_per_pass >> (-(-num_splits // 8) - 1).bit_length())
    rows_per_pass = min(rows_per_pass, 1 << (max(1, rows // num_sms).bit_length() - 1))
    return threads, (max(1, min(-(-rows // rows_per_pass), 2**31 - 1)), 1, 1)


def launch_combine(out_partial, lse_partial, out, lse, *, partial_strides, lse_partial_strides,
                   out_strides, lse_strides, num_splits, batch, seqlen, nheads, head_dim) -> None:
    """Merge split-KV partials. Strides are (split, batch, row, head) for partials and
    (batch, row, head) for outputs, in elements."""
    index = device_index(out)
    info = device_info(index)
    spec = _combine_spec(info.capability, out.dtype)
    values = dict(
        out_partial_ptr=out_partial.data_ptr(), lse_partial_ptr=lse_partial.data_ptr(),
        out_ptr=out.data_ptr(), lse_ptr=lse.data_ptr(),
        num_splits=num_splits, batch=batch, seqlen=seqlen, nheads=nheads, head_dim=head_dim,
    )
    for prefix, names, strides in (
        ("out_partial", ("split", "batch", "row", "head"), partial_strides),
        ("lse_partial", ("split", "batch", "row", "head"), lse_partial_strides),
        ("out", ("batch", "row", "head"), out_strides),
        ("lse", ("batch", "row", "head"), lse_strides),
    ):
        values.update({f"{prefix}_{n}_stride": st for n, st in zip(names, strides)})
    threads, grid = _combine_geometry(num_splits, batch * seqlen * nheads, head_dim, info.num_sms)
    # On sm_90+ the combine is a programmatic dependent launch: its CTAs are resident when the
    # forward's last ones finish (combine.cuh waits with griddepcontrol.wait), hiding its launch.
    _launch(spec, 0, threads, grid, params_mod.pack(params_mod.COMBINE_LAYOUT, values), index,
            dependent=DEPENDENT_COMBINE and info.capability[0] >= 9)


def _ptr(t) -> int:
    return t.data_ptr() if t is not None else 0


def _rows3(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, row, head) strides of a dense (batch, seqlen, heads, d) tensor, or of a varlen
    (total, heads, d) one, whose sequences are found through cu_seqlens (batch stride 0)."""
    return t.stride()[:3] if t.dim() == 4 else (0, *t.stride()[:2])


def run_fwd(
    plan: FwdPlan, *, q, k, v, out, lse, softmax_scale, softcap, alibi_slopes, seqlen_k,
    seqused_k=None, seqlen_k_new=0, leftpad_k=None, kv_batch_idx=None, block_table=None,
    page_size=1, kv_batch=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
    dropout=None, max_seqlen_q=None,
) -> None:
    """Launch a planned forward (and the split-KV combine) writing ``out`` and ``lse``.

    Dense: q (batch, seqlen_q, nheads, d), lse (batch, nheads, seqlen_q). Varlen (cu_seqlens_q):
    q (total_q, nheads, d), lse (nheads, total_q); ``seqlen_k`` is then the K/V rows (or the paged
    capacity) that reads never pass, and ``max_seqlen_q`` the longest sequence's query rows."""
    nheads, head_dim = q.shape[-2], q.shape[-1]
    nheads_k = k.shape[-2]
    if cu_seqlens_q is not None:
        batch, seqlen_q = cu_seqlens_q.shape[0] - 1, q.shape[0]  # seqlen_q: rows of q
        partial_rows = seqlen_q
        lse_strides = (0, 1, seqlen_q)  # (batch, row, head) of (nheads, total_q)
    else:
        batch, seqlen_q = q.shape[0], q.shape[1]
        partial_rows = batch * seqlen_q
        lse_strides = (nheads * seqlen_q, 1, seqlen_q)
    has_softcap = softcap > 0
    splits = plan.num_splits
    if splits > 1 and not plan.merge_in_cluster:
        # One allocation for both partial buffers (an allocation is several microseconds).
        o_elems = splits * partial_rows * nheads * head_dim
        scratch = torch.empty(o_elems + splits * partial_rows * nheads, dtype=torch.float32, device=q.device)
        oaccum = scratch[:o_elems]
        lseaccum = scratch[o_elems:]
        if seqused_q is not None:
            lseaccum.fill_(-float("inf"))  # rows past seqused_q: no split writes them, the combine gives 0
    else:
        oaccum = lseaccum = None
    index = device_index(q)
    # An sm90 instance wider than the call (a head dim between two instances) stores all of its
    # columns: into a padded O (zeroed where the kernel writes no rows: past seqused_q), whose
    # call's columns are copied out after the launch. (Its split-KV partials have the call's.)
    padded_out = None
    if plan.spec.head_dim > head_dim and plan.spec.family == "sm90" and splits == 1:
        alloc = torch.empty if seqused_q is None else torch.zeros
        padded_out = alloc((*out.shape[:-1], plan.spec.head_dim), dtype=out.dtype, device=out.device)
    o_tensor = out if padded_out is None else padded_out
    packed = params_mod.pack_fwd_values(
        q_ptr=q.data_ptr(), k_ptr=k.data_ptr(), v_ptr=v.data_ptr(), o_ptr=o_tensor.data_ptr(),
        lse_ptr=lse.data_ptr(), alibi_slopes_ptr=_ptr(alibi_slopes), seqused_k_ptr=_ptr(seqused_k),
        leftpad_k_ptr=_ptr(leftpad_k), kv_batch_idx_ptr=_ptr(kv_batch_idx), block_table_ptr=_ptr(block_table),
        oaccum_ptr=_ptr(oaccum), lseaccum_ptr=_ptr(lseaccum), cu_seqlens_q_ptr=_ptr(cu_seqlens_q),
        cu_seqlens_k_ptr=_ptr(cu_seqlens_k), seqused_q_ptr=_ptr(seqused_q),
        q_strides=_rows3(q), k_strides=_rows3(k), v_strides=_rows3(v), o_strides=_rows3(o_tensor),
        alibi_batch_stride=alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
        block_table_batch_stride=block_table.stride(0) if block_table is not None else 0,
        lse_batch_stride=lse_strides[0], lse_head_stride=lse_strides[2], partial_rows=partial_rows,
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, seqlen_k_new=seqlen_k_new,
        max_seqlen_q=seqlen_q if max_seqlen_q is None else max_seqlen_q,
        kv_batch=kv_batch if kv_batch is not None else (batch if cu_seqlens_k is not None else k.shape[0]),
        num_splits=splits, merge_in_cluster=int(plan.merge_in_cluster),
        nheads=nheads, nheads_k=nheads_k, head_dim=head_dim,
        window_left=plan.window_left, window_right=plan.window_right,
        kv_head_group=plan.kv_head_group, qhead_per_khead=nheads // nheads_k * plan.kv_head_group,
        page_size=page_size,
        scale_log2=_LOG2E if has_softcap else softmax_scale * _LOG2E,
        softmax_scale=softmax_scale,
        softcap_scale=softmax_scale / softcap if has_softcap else 0.0,
        softcap=float(softcap),
        alibi_scale=1.0 if has_softcap else 1.0 / softmax_scale,
        **(dropout.params() if dropout is not None and dropout.p > 0 else NO_DROPOUT_PARAMS),
    )
    if plan.spec.family == "sm90":  # the TMA maps of Q, K, V before the FwdParams
        group = nheads // nheads_k if plan.spec.pack_gqa else 1
        packed = tma.sm90_fwd_params(q, k, v, plan.tile.block_m, plan.tile.block_n, packed, group)
    _launch(plan.spec, plan.smem_bytes, plan.tile.num_threads, plan.grid, packed, index,
            dependent=plan.dependent_launch, cluster=(1, 1, splits) if plan.merge_in_cluster else None)
    if padded_out is not None:
        out.copy_(padded_out[..., :head_dim])
    if splits > 1 and not plan.merge_in_cluster:
        # Partials are (split, row, head[, d]) with rows numbered across the batch; the combine
        # sees a varlen call as one sequence of total_q rows.
        row_o, row_lse = nheads * head_dim, nheads
        launch_combine(
            oaccum, lseaccum, out, lse,
            partial_strides=(partial_rows * row_o, seqlen_q * row_o, row_o, head_dim),
            lse_partial_strides=(partial_rows * row_lse, seqlen_q * row_lse, row_lse, 1),
            out_strides=_rows3(out), lse_strides=lse_strides, num_splits=splits,
            batch=batch if cu_seqlens_q is None else 1, seqlen=seqlen_q, nheads=nheads, head_dim=head_dim,
        )


def _fwd(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, pack_gqa, num_splits,
         dropout_p=0.0):
    """Validated dense forward: returns (out, softmax_lse, dropout state)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return out, lse, NO_DROPOUT
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    index = device_index(q)
    info = device_info(index)
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    plan: FwdPlan = plan_fwd(
        dtype=q.dtype, head_dim=head_dim, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        nheads=nheads, nheads_k=nheads_k, causal=causal, window_size=tuple(window_size),
        softcap=float(softcap), pack_gqa=pack_gqa, device=info,
        num_splits=num_splits, family=config.forced_family(), dropout=dropout_p > 0,
        # The TMA checks only where an sm90 instance could run (Hopper), not on every call.
        sm90=info.capability[0] == 9 and tma.compatible(q, k, v),
        kv_heads_adjacent=k.stride(2) == head_dim and v.stride(2) == head_dim,
    )
    validate.grid(plan)
    dropout = draw_dropout(dropout_p, index)
    run_fwd(plan, q=q, k=k, v=v, out=out, lse=lse,
            softmax_scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes, seqlen_k=seqlen_k,
            dropout=dropout)
    return out, lse, dropout


# The forward and backward as torch.library custom ops: autograd connects them, and
# torch.compile(fullgraph=True) traces a model that calls flashgen without a graph break (the fake
# implementations give output shapes without touching a GPU). rng_state (int64 [seed, offset], on
# the CPU) carries a dropout call's Philox state to its backward.
@torch.library.custom_op("flashgen::fwd", mutates_args=(), device_types="cuda")
def _fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
    window_left: int, window_right: int, softcap: float, alibi_slopes: typing.Optional[torch.Tensor],
    pack_gqa: typing.Optional[bool], num_splits: int, dropout_p: float, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    del deterministic  # a backward option, carried here so that autograd can hand it over
    out, lse, dropout = _fwd(q, k, v, softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes,
                             pack_gqa, num_splits, dropout_p)
    return out, lse, dropout.rng_state()


@_fwd_op.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, pack_gqa,
              num_splits, dropout_p, deterministic):
    batch, seqlen_q, nheads, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32),
            torch.empty(2, dtype=torch.int64, device="cpu"))


@torch.library.custom_op("flashgen::bwd", mutates_args=("dq", "dk", "dv"), device_types="cuda")
def _bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, softmax_scale: float,
    causal: bool, window_left: int, window_right: int, softcap: float,
    alibi_slopes: typing.Optional[torch.Tensor], dropout_p: float, rng_state: torch.Tensor, deterministic: bool,
) -> None:
    from .backward import flash_bwd

    flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=softmax_scale, causal=causal,
              window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
              deterministic=deterministic, dropout=dropout_from_rng_state(dropout_p, rng_state))


@_bwd_op.register_fake
def _bwd_fake(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, window_left, window_right,
              softcap, alibi_slopes, dropout_p, rng_state, deterministic) -> None:
    return None


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, _, _, dropout_p, deterministic = inputs
    out, lse, rng_state = output
    # Slopes go through save_for_backward too, so an in-place change before backward is caught.
    ctx.save_for_backward(q, k, v, out, lse, rng_state, *([alibi_slopes] if alibi_slopes is not None else []))
    ctx.options = (softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic)
    ctx.mark_non_differentiable(lse, rng_state)


def _fwd_backward(ctx, dout, dlse, drng):
    del dlse, drng  # lse and rng_state are not differentiable
    q, k, v, out, lse, rng_state, *alibi = ctx.saved_tensors
    softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic = ctx.options
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _bwd_op(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, window_left, window_right,
            softcap, alibi[0] if alibi else None, dropout_p, rng_state, deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, pack_gqa=None, num_splits=1,
):
    """Attention over q (batch, seqlen_q, nheads, d), k/v (batch, seqlen_k, nheads_k, d).

    flash_attn 2.x semantics. ``dropout_p`` drops attention probabilities with a Philox mask drawn
    from PyTorch's CUDA generator (reproducible under torch.manual_seed; not inside CUDA graph
    capture). Returns ``out``, or ``(out, softmax_lse, None)`` when ``return_attn_probs``
    (softmax_lse: float32 (batch, nheads, seqlen_q), natural log; flashgen does not materialize
    the probabilities or the dropout pattern: flashgen.testing.dropout_keep_mask recomputes the
    pattern from the rng state).
    """
    window_size = validate.fwd(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_attn_probs, pack_gqa, num_splits)
    head_dim = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    if head_dim % HEAD_DIM_MULTIPLE:
        q, k, v = pad_head_dim(q), pad_head_dim(k), pad_head_dim(v)
    args = (q, k, v, float(softmax_scale), bool(causal), *window_size, float(softcap), alibi_slopes, pack_gqa,
            int(num_splits))
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if needs_grad or torch.compiler.is_compiling():
        out, lse, _ = _fwd_op(*args, float(dropout_p), bool(deterministic))
    else:
        # Eager inference skips the custom-op dispatch (tens of microseconds per call).
        out, lse, _ = _fwd(*args[:5], window_size, *args[7:], float(dropout_p))
    if head_dim % HEAD_DIM_MULTIPLE:
        out = out[..., :head_dim]
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(
    qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, pack_gqa=None, num_splits=1,
):
    """qkv (batch, seqlen, 3, nheads, d)."""
    window_size = validate.qkvpacked(qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                     deterministic, return_attn_probs, pack_gqa, num_splits)
    return flash_attn_func(
        qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, deterministic, return_attn_probs, pack_gqa, num_splits,
    )


def flash_attn_kvpacked_func(
    q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, pack_gqa=None, num_splits=1,
):
    """q (batch, seqlen_q, nheads, d), kv (batch, seqlen_k, 2, nheads_k, d)."""
    window_size = validate.kvpacked(q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                    deterministic, return_attn_probs, pack_gqa, num_splits)
    return flash_attn_func(
        q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic, return_attn_probs, pack_gqa, num_splits,
    )


# ---------------------------------------------------------------------------------------------
# Variable-length batches: sequences packed along one row dimension, delimited by cu_seqlens.


def _clamp_max_seqlens(max_seqlen_q: int, max_seqlen_k: int, total_q: int, capacity: int) -> tuple[int, int]:
    """No sequence has more rows than its tensor (the kernels clamp each one to it): a larger
    max_seqlen would only size the grid, the sm90 schedule or the backward's buffers for rows that
    do not exist. ``capacity``: the key rows (or the paged capacity)."""
    return min(max_seqlen_q, total_q), min(max_seqlen_k, capacity)


def _varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_size, softcap, alibi_slopes, block_table, seqused_q, seqused_k, pack_gqa, num_splits,
                dropout_p=0.0):
    """Validated varlen forward: returns (out (total_q, nheads, d), softmax_lse (nheads, total_q),
    dropout state)."""
    total_q, nheads, head_dim = q.shape
    nheads_k = k.shape[-2]
    batch = cu_seqlens_q.shape[0] - 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    paged = block_table is not None
    if paged:
        page_size, capacity, kv_batch = k.shape[1], block_table.shape[1] * k.shape[1], k.shape[0]
        if block_table.stride(-1) != 1:
            block_table = block_table.contiguous()
    else:
        page_size, capacity, kv_batch = 1, k.shape[0], batch
    if config.check_inputs():
        validate.varlen_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, capacity, paged,
                               block_table, page_size, k.shape[0], seqused_q, seqused_k)
    if total_q == 0 or nheads == 0 or max_seqlen_q == 0:
        lse.fill_(-float("inf"))
        out.zero_()
        return out, lse, NO_DROPOUT
    max_seqlen_q, max_seqlen_k = _clamp_max_seqlens(max_seqlen_q, max_seqlen_k, total_q, capacity)
    index = device_index(q)
    info = device_info(index)
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    plan: FwdPlan = plan_fwd(
        dtype=q.dtype, head_dim=head_dim, batch=batch, seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k,
        nheads=nheads, nheads_k=nheads_k, causal=causal, window_size=tuple(window_size),
        softcap=float(softcap), pack_gqa=pack_gqa, device=info, paged=paged,
        num_splits=num_splits, family=config.forced_family(), varlen=True, dropout=dropout_p > 0,
        varlen_uniform=seqused_q is None and seqused_k is None and not paged
        and total_q == batch * max_seqlen_q and capacity == batch * max_seqlen_k,
        sm90=info.capability[0] == 9 and tma.compatible(q, k, v), page_size=page_size if paged else 0,
    )
    validate.grid(plan)
    dropout = draw_dropout(dropout_p, index)
    if seqused_q is not None and plan.num_splits == 1:
        # Rows past seqused_q belong to no sequence: the kernel does not write them.
        out.zero_()
        lse.fill_(-float("inf"))
    run_fwd(plan, q=q, k=k, v=v, out=out, lse=lse,
            softmax_scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes, seqlen_k=capacity,
            seqused_k=seqused_k, block_table=block_table, page_size=page_size, kv_batch=kv_batch,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, dropout=dropout,
            max_seqlen_q=max_seqlen_q)
    return out, lse, dropout


@torch.library.custom_op("flashgen::varlen_fwd", mutates_args=(), device_types="cuda")
def _varlen_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
    window_right: int, softcap: float, alibi_slopes: typing.Optional[torch.Tensor],
    seqused_q: typing.Optional[torch.Tensor], seqused_k: typing.Optional[torch.Tensor],
    pack_gqa: typing.Optional[bool], num_splits: int, dropout_p: float, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    del deterministic  # a backward option, carried for autograd
    out, lse, dropout = _varlen_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        (window_left, window_right), softcap, alibi_slopes, None, seqused_q, seqused_k, pack_gqa, num_splits,
        dropout_p)
    return out, lse, dropout.rng_state()


@_varlen_fwd_op.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     window_left, window_right, softcap, alibi_slopes, seqused_q, seqused_k, pack_gqa, num_splits,
                     dropout_p, deterministic):
    return (q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32),
            torch.empty(2, dtype=torch.int64, device="cpu"))


@torch.library.custom_op("flashgen::varlen_bwd", mutates_args=("dq", "dk", "dv"), device_types="cuda")
def _varlen_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
    window_right: int, softcap: float, alibi_slopes: typing.Optional[torch.Tensor],
    seqused_q: typing.Optional[torch.Tensor], seqused_k: typing.Optional[torch.Tensor], dropout_p: float,
    rng_state: torch.Tensor, deterministic: bool,
) -> None:
    _varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, seqused_q, seqused_k,
                dropout_p, rng_state, deterministic)


def _varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, seqused_q, seqused_k,
                dropout_p, rng_state, deterministic) -> None:
    """The varlen backward op's body: dq, dk, dv (total rows, heads, d) written in place."""
    from .backward import flash_bwd

    max_seqlen_q, max_seqlen_k = _clamp_max_seqlens(max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0])
    flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=softmax_scale, causal=causal,
              window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
              deterministic=deterministic, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k,
              dropout=dropout_from_rng_state(dropout_p, rng_state))


@_varlen_bwd_op.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, seqused_q, seqused_k,
                     dropout_p, rng_state, deterministic) -> None:
    return None


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
     seqused_q, seqused_k, _, _, dropout_p, deterministic) = inputs
    out, lse, rng_state = output
    optional = [t for t in (alibi_slopes, seqused_q, seqused_k) if t is not None]
    ctx.save_for_backward(q, k, v, out, lse, rng_state, cu_q, cu_k, *optional)
    ctx.present = (alibi_slopes is not None, seqused_q is not None, seqused_k is not None)
    ctx.options = (max_q, max_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic)
    ctx.mark_non_differentiable(lse, rng_state)


def _varlen_backward(ctx, dout, dlse, drng):
    del dlse, drng  # lse and rng_state are not differentiable
    q, k, v, out, lse, rng_state, cu_q, cu_k, *optional = ctx.saved_tensors
    alibi_slopes, seqused_q, seqused_k = (optional.pop(0) if present else None for present in ctx.present)
    max_q, max_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic = ctx.options
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _varlen_bwd_op(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, softmax_scale, causal,
                   window_left, window_right, softcap, alibi_slopes, seqused_q, seqused_k, dropout_p, rng_state,
                   deterministic)
    return (dq, dk, dv) + (None,) * 16


_varlen_fwd_op.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


class _PagedVarlenFwd(torch.autograd.Function):
    """A paged varlen forward (block_table) whose inputs require grad: the forward runs, a backward
    through it raises (flash_attn 2 has no backward for paged keys either)."""

    @staticmethod
    def forward(ctx, *args):
        out, lse, _ = _varlen_fwd(*args)  # no dropout state: validation refuses dropout with block_table
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "block_table: a paged varlen call has no backward (paged keys are for inference); pass k/v as "
            "(total_k, nheads_k, head_dim) to train through it"
        )


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None, seqused_q=None, seqused_k=None, pack_gqa=None, num_splits=1,
):
    """Attention over a batch of sequences packed without padding (flash_attn 2.x semantics, plus
    FA3's ``seqused_q/k``, ``pack_gqa`` and ``num_splits``).

    q (total_q, nheads, d); k/v (total_k, nheads_k, d), or with ``block_table`` (batch, max_pages)
    int32 a paged cache (num_pages, page_size, nheads_k, d) whose sequence b has the keys counted
    by cu_seqlens_k (or seqused_k). cu_seqlens_q/k: int32 (batch + 1,) cumulative lengths;
    max_seqlen_q/k: the longest sequences. Returns ``out`` (total_q, nheads, d), or
    ``(out, softmax_lse, None)`` with softmax_lse float32 (nheads, total_q). Rows past seqused_q
    come out as 0 with lse -inf. With cu_seqlens that do not end at total_q, or a max_seqlen below
    a real length, rows are left unwritten (wrong answers, never stray accesses);
    FLASHGEN_CHECK_INPUTS=1 reports such values.
    """
    window_size = validate.varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, seqused_q, seqused_k,
        pack_gqa, num_splits)
    head_dim = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    if head_dim % HEAD_DIM_MULTIPLE:  # paged: the pages are copied too, as flash_attn 2 does
        q, k, v = pad_head_dim(q), pad_head_dim(k), pad_head_dim(v)
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if block_table is not None:
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                "block_table: paged varlen calls are not traceable by torch.compile yet (no custom op takes a "
                "block table); call them outside the compiled region"
            )
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(softmax_scale), bool(causal),
                window_size, float(softcap), alibi_slopes, block_table, seqused_q, seqused_k, pack_gqa,
                int(num_splits), float(dropout_p))
        if needs_grad:
            out, lse = _PagedVarlenFwd.apply(*args)
        else:
            out, lse, _ = _varlen_fwd(*args)
    else:
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(softmax_scale),
                bool(causal), *window_size, float(softcap), alibi_slopes, seqused_q, seqused_k, pack_gqa,
                int(num_splits))
        if needs_grad or torch.compiler.is_compiling():
            out, lse, _ = _varlen_fwd_op(*args, float(dropout_p), bool(deterministic))
        else:
            out, lse, _ = _varlen_fwd(*args[:9], window_size, args[11], args[12], None, *args[13:], float(dropout_p))
    if head_dim % HEAD_DIM_MULTIPLE:
        out = out[..., :head_dim]
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_qkvpacked_func(
    qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
):
    """qkv (total, 3, nheads, d); cu_seqlens int32 (batch + 1,)."""
    window_size = validate.varlen_qkvpacked(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                            window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    return flash_attn_varlen_func(
        qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )


def flash_attn_varlen_kvpacked_func(
    q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False,
):
    """q (total_q, nheads, d), kv (total_k, 2, nheads_k, d)."""
    validate.varlen_kvpacked(q, kv)
    return flash_attn_varlen_func(
        q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )
