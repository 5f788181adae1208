"""The one definition of the kernel Params struct.

FWD_PARAMS below is the only place its fields are listed. From it come
  * the device struct (rendered into ``flash_params.cuh``, with a static_assert on every offset and
    on the size, so any NVRTC compile proves the device layout equals the host layout), and
  * the host packing: one precompiled ``struct.Struct`` (a single ``pack_into`` per launch).
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import struct
from typing import Sequence

# kind -> (C type, struct format char(s), size, alignment)
_KINDS = {
    "ptr": ("void*", "Q", 8, 8),
    "i64": ("long long", "q", 8, 8),
    "i32": ("int", "i", 4, 4),
    "u32": ("unsigned int", "I", 4, 4),
    "f32": ("float", "f", 4, 4),
    # A precomputed divisor for fast division on the device: {divisor, multiplier, shift}.
    "divmod": ("FastDivmod", "iII", 12, 4),
}


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    kind: str
    doc: str


FWD_PARAMS: tuple[Field, ...] = (
    Field("q_ptr", "ptr", "query (batch, seqlen_q, nheads, d), or varlen (total_q, nheads, d)"),
    Field("k_ptr", "ptr", "key (batch, seqlen_k, nheads_k, d), varlen (total_k, nheads_k, d), or paged"),
    Field("v_ptr", "ptr", "value, like k"),
    Field("o_ptr", "ptr", "output, same layout as q"),
    Field("lse_ptr", "ptr", "float softmax_lse (batch, nheads, seqlen_q) or varlen (nheads, total_q), natural log"),
    Field("alibi_slopes_ptr", "ptr", "float ALiBi slopes (batch?, nheads), or null"),
    Field("seqused_k_ptr", "ptr", "int32 (batch,): keys in use per batch element (cache_seqlens; varlen seqused_k), or null"),
    Field("leftpad_k_ptr", "ptr", "int32 (batch,): first valid key per batch element, or null"),
    Field("kv_batch_idx_ptr", "ptr", "int32 (batch,): K/V batch row of each batch element, or null"),
    Field("block_table_ptr", "ptr", "int32 (batch, max_pages): paged K/V (k/v are (pages, page_size, hk, d)), or null"),
    Field("oaccum_ptr", "ptr", "float partial O, contiguous (num_splits, partial_rows, nheads, head_dim)"),
    Field("lseaccum_ptr", "ptr", "float partial lse, contiguous (num_splits, partial_rows, nheads)"),
    Field("cu_seqlens_q_ptr", "ptr", "int32 (batch + 1,): varlen q, sequence b is rows [cu[b], cu[b+1]) of q; or null"),
    Field("cu_seqlens_k_ptr", "ptr", "int32 (batch + 1,): varlen k/v (rows of k/v, or lengths when paged); or null"),
    Field("seqused_q_ptr", "ptr", "int32 (batch,): query rows in use per sequence, or null"),
    Field("q_batch_stride", "i64", "elements"),
    Field("q_row_stride", "i64", "elements"),
    Field("q_head_stride", "i64", "elements"),
    Field("k_batch_stride", "i64", "elements"),
    Field("k_row_stride", "i64", "elements"),
    Field("k_head_stride", "i64", "elements"),
    Field("v_batch_stride", "i64", "elements"),
    Field("v_row_stride", "i64", "elements"),
    Field("v_head_stride", "i64", "elements"),
    Field("o_batch_stride", "i64", "elements"),
    Field("o_row_stride", "i64", "elements"),
    Field("o_head_stride", "i64", "elements"),
    Field("alibi_batch_stride", "i64", "elements; 0 when slopes are (nheads,)"),
    Field("block_table_batch_stride", "i64", "elements"),
    Field("lse_batch_stride", "i64", "elements; 0 for varlen"),
    Field("lse_head_stride", "i64", "elements (lse rows are contiguous)"),
    Field("partial_rows", "i64", "rows of one split's partials: batch * seqlen_q, or total_q for varlen"),
    Field("philox_seed", "i64", "dropout: RNG seed (see Dropout in common.cuh)"),
    Field("philox_offset", "i64", "dropout: RNG offset of this call"),
    Field("batch", "i32", ""),
    Field("seqlen_q", "i32", "query rows per sequence, or for varlen the rows of q (total_q)"),
    Field("max_seqlen_q", "i32", "query rows of the longest sequence (seqlen_q unless varlen): sm90's row blocks per head"),
    Field("seqlen_k", "i32", "keys, or with seqused_k / varlen the capacity of a K/V row (reads never pass it)"),
    Field("seqlen_k_new", "i32", "keys appended by this call: a batch element uses seqused_k[b] + this"),
    Field("kv_batch", "i32", "K/V batch rows (or pages when paged): indices outside are treated as empty"),
    Field("num_splits", "i32", "split-KV: > 1 writes partials to oaccum/lseaccum"),
    Field("merge_in_cluster", "i32",
          "decode split-KV on sm_90+: a tile's splits are one cluster and merge through distributed "
          "shared memory (no partials in global memory, no combine kernel); 0 otherwise"),
    Field("nheads", "i32", "query heads"),
    Field("nheads_k", "i32", "key/value heads"),
    Field("head_dim", "i32", "actual head dim (<= the instance's), a multiple of 8"),
    Field("window_left", "i32", "local: keys visible left of the diagonal (>= 0)"),
    Field("window_right", "i32", "causal/local: keys visible right of the diagonal (>= 0)"),
    Field("kv_head_group", "i32",
          "KV heads one CTA reads (1, or 2 for decode over adjacent heads: FwdPlan.kv_head_group)"),
    Field("qhead_per_khead", "divmod", "query heads per CTA head index: nheads / nheads_k * kv_head_group"),
    Field("page_size", "divmod", "rows per page when paged (1 otherwise)"),
    Field("scale_log2", "f32", "log2(e) times the scale of the scores the softmax sees"),
    Field("softmax_scale", "f32", ""),
    Field("softcap_scale", "f32", "softmax_scale / softcap"),
    Field("softcap", "f32", "0 when off"),
    Field("alibi_scale", "f32", "ALiBi slope multiplier into score units"),
    Field("dropout_threshold", "u32", "keep a probability iff its random byte < this; 256: no dropout"),
    Field("rp_dropout", "f32", "scale of kept probabilities: 256 / dropout_threshold"),
)


def _strided(prefix: str, dims: Sequence[str], doc: str) -> tuple[Field, ...]:
    return tuple(Field(f"{prefix}_{dim}_stride", "i64", doc) for dim in dims)


COMBINE_PARAMS: tuple[Field, ...] = (
    Field("out_partial_ptr", "ptr", "float (num_splits, batch, seqlen, nheads, head_dim), last dim contiguous"),
    Field("lse_partial_ptr", "ptr", "float (num_splits, batch, seqlen, nheads)"),
    Field("out_ptr", "ptr", "out dtype (batch, seqlen, nheads, head_dim), last dim contiguous"),
    Field("lse_ptr", "ptr", "float (batch, seqlen, nheads)"),
    *_strided("out_partial", ("split", "batch", "row", "head"), "elements"),
    *_strided("lse_partial", ("split", "batch", "row", "head"), "elements"),
    *_strided("out", ("batch", "row", "head"), "elements"),
    *_strided("lse", ("batch", "row", "head"), "elements"),
    Field("num_splits", "i32", ""),
    Field("batch", "i32", ""),
    Field("seqlen", "i32", ""),
    Field("nheads", "i32", ""),
    Field("head_dim", "i32", "a multiple of 4"),
)

APPEND_PARAMS: tuple[Field, ...] = (
    Field("q_ptr", "ptr", "(batch, seqlen_q, nheads, d)"),
    Field("q_out_ptr", "ptr", "rotated q, same shape"),
    Field("k_new_ptr", "ptr", "(batch, seqlen_new, nheads_k, d)"),
    Field("v_new_ptr", "ptr", "(batch, seqlen_new, nheads_k, d)"),
    Field("k_cache_ptr", "ptr", "(batch_cache, capacity, nheads_k, d) or (pages, page_size, nheads_k, d)"),
    Field("v_cache_ptr", "ptr", "same as k_cache"),
    Field("cos_ptr", "ptr", "float (seqlen_ro, rotary_dim / 2), contiguous"),
    Field("sin_ptr", "ptr", "float (seqlen_ro, rotary_dim / 2), contiguous"),
    Field("cache_seqlens_ptr", "ptr", "int32 (batch,)"),
    Field("cache_batch_idx_ptr", "ptr", "int32 (batch,), or null"),
    Field("block_table_ptr", "ptr", "int32 (batch, max_pages), or null"),
    *_strided("q", ("batch", "row", "head"), "elements"),
    *_strided("q_out", ("batch", "row", "head"), "elements"),
    *_strided("k_new", ("batch", "row", "head"), "elements"),
    *_strided("v_new", ("batch", "row", "head"), "elements"),
    *_strided("k_cache", ("batch", "row", "head"), "elements; batch = page when paged"),
    *_strided("v_cache", ("batch", "row", "head"), "elements; batch = page when paged"),
    Field("block_table_batch_stride", "i64", "elements"),
    Field("batch", "i32", ""),
    Field("seqlen_q", "i32", ""),
    Field("seqlen_new", "i32", ""),
    Field("nheads", "i32", ""),
    Field("nheads_k", "i32", ""),
    Field("head_dim", "i32", ""),
    Field("rotary_dim", "i32", "even, <= head_dim; 0 = no rotary"),
    Field("seqlen_ro", "i32", "rows of the cos/sin tables"),
    Field("cache_capacity", "i32", "positions per cache row (max_pages * page_size when paged)"),
    Field("cache_batch", "i32", "cache rows (pages when paged)"),
    Field("rotary_interleaved", "i32", "1: GPT-J pairs (2j, 2j+1); 0: GPT-NeoX (j, j + rotary_dim/2)"),
    Field("q_rotary_per_row", "i32", "1 (causal/local): q row i at cache_seqlens + i; 0: all at cache_seqlens"),
    Field("page_size", "divmod", ""),
)


BWD_PARAMS: tuple[Field, ...] = (
    Field("q_ptr", "ptr", "(batch, seqlen_q, nheads, d)"),
    Field("k_ptr", "ptr", "(batch, seqlen_k, nheads_k, d)"),
    Field("v_ptr", "ptr", "(batch, seqlen_k, nheads_k, d)"),
    Field("do_ptr", "ptr", "dO, like q"),
    Field("lse_log2_ptr", "ptr",
          "float (batch, nheads, seqlen_q): the forward's softmax_lse times log2(e), +inf where it is -inf "
          "(rows that saw no key), from the preprocess"),
    Field("dsum_ptr", "ptr", "float (batch, nheads, seqlen_q): rowsum(dO * O) from the preprocess"),
    Field("dq_accum_ptr", "ptr", "float (batch, nheads, seqlen_q, head_dim), zeroed by the preprocess"),
    Field("dk_ptr", "ptr", "like k"),
    Field("dv_ptr", "ptr", "like v"),
    Field("alibi_slopes_ptr", "ptr", "float ALiBi slopes (batch?, nheads), or null"),
    Field("semaphore_ptr", "ptr", "int (batch, nheads, d slices, query blocks of max_seqlen_q), zeroed: deterministic dQ; or null"),
    Field("cu_seqlens_q_ptr", "ptr", "int32 (batch + 1,): varlen q/dO rows per sequence, or null"),
    Field("cu_seqlens_k_ptr", "ptr", "int32 (batch + 1,): varlen k/v rows per sequence, or null"),
    Field("seqused_q_ptr", "ptr", "int32 (batch,): query rows in use per sequence, or null"),
    Field("seqused_k_ptr", "ptr", "int32 (batch,): keys in use per sequence, or null"),
    *_strided("q", ("batch", "row", "head"), "elements"),
    *_strided("k", ("batch", "row", "head"), "elements"),
    *_strided("v", ("batch", "row", "head"), "elements"),
    *_strided("do", ("batch", "row", "head"), "elements"),
    *_strided("dk", ("batch", "row", "head"), "elements"),
    *_strided("dv", ("batch", "row", "head"), "elements"),
    Field("alibi_batch_stride", "i64", "elements; 0 when slopes are (nheads,)"),
    Field("stats_batch_stride", "i64", "rows of lse / dsum / dq_accum per batch element (0 for varlen)"),
    Field("stats_head_stride", "i64", "rows of lse / dsum / dq_accum per head"),
    Field("philox_seed", "i64", "dropout: the forward's RNG seed"),
    Field("philox_offset", "i64", "dropout: the forward's RNG offset"),
    Field("batch", "i32", ""),
    Field("seqlen_q", "i32", "query rows per sequence, or for varlen the rows of q (total_q)"),
    Field("seqlen_k", "i32", "keys per sequence, or for varlen the rows of k (total_k)"),
    Field("max_seqlen_q", "i32", "longest query sequence (the semaphores' query-block stride)"),
    Field("nheads", "i32", ""),
    Field("nheads_k", "i32", ""),
    Field("head_dim", "i32", ""),
    Field("window_left", "i32", "as in FwdParams"),
    Field("window_right", "i32", "as in FwdParams"),
    Field("scale_log2", "f32", "as in FwdParams"),
    Field("softmax_scale", "f32", ""),
    Field("softcap_scale", "f32", "softmax_scale / softcap"),
    Field("softcap", "f32", "0 when off"),
    Field("alibi_scale", "f32", "as in FwdParams"),
    Field("dropout_threshold", "u32", "as in FwdParams"),
    Field("rp_dropout", "f32", "as in FwdParams"),
    Field("dq_turns_descending", "i32",
          "deterministic sm90 dQ: 1 = key blocks add to a query block last first (grid reversed, query "
          "blocks ascending), 0 = first first; the plan's choice (BwdPlan.dq_turns_descending)"),
    Field("cta_chunks", "i32",
          "sm90: 0 = CTAs in launch order (key blocks fastest); C > 0 = the (batch, KV head) pairs in C "
          "even chunks, key blocks slowest within each (BwdPlan.cta_chunks)"),
)

BWD_ROW_PARAMS: tuple[Field, ...] = (
    Field("o_ptr", "ptr", "the forward's output (batch, seqlen_q, nheads, d)"),
    Field("do_ptr", "ptr", "dO, like o"),
    Field("lse_ptr", "ptr", "float (batch, nheads, seqlen_q): the forward's softmax_lse"),
    Field("lse_log2_ptr", "ptr", "float (batch, nheads, seqlen_q): lse in log2 units for the main kernel"),
    Field("dsum_ptr", "ptr", "float (batch, nheads, seqlen_q)"),
    Field("dq_accum_ptr", "ptr", "float (batch, nheads, seqlen_q, head_dim)"),
    Field("dq_ptr", "ptr", "dQ, like q"),
    *_strided("o", ("batch", "row", "head"), "elements"),
    *_strided("do", ("batch", "row", "head"), "elements"),
    *_strided("dq", ("batch", "row", "head"), "elements"),
    Field("batch", "i32", ""),
    Field("seqlen_q", "i32", ""),
    Field("nheads", "i32", ""),
    Field("head_dim", "i32", ""),
    Field("softmax_scale", "f32", "dQ = softmax_scale * dq_accum"),
)


@dataclasses.dataclass(frozen=True)
class Layout:
    fields: tuple[Field, ...]
    offsets: tuple[int, ...]
    size: int
    fmt: str


def compute_layout(fields: Sequence[Field]) -> Layout:
    """C layout rules: each field at the next multiple of its alignment; size rounded up to the
    largest alignment."""
    offset = 0
    max_align = 1
    offsets = []
    fmt = ["<"]
    for f in fields:
        _, chars, size, align = _KINDS[f.kind]
        pad = (-offset) % align
        if pad:
            fmt.append(f"{pad}x")
        offset += pad
        offsets.append(offset)
        fmt.append(chars)
        offset += size
        max_align = max(max_align, align)
    tail = (-offset) % max_align
    if tail:
        fmt.append(f"{tail}x")
    return Layout(tuple(fields), tuple(offsets), offset + tail, "".join(fmt))


FWD_LAYOUT = compute_layout(FWD_PARAMS)
COMBINE_LAYOUT = compute_layout(COMBINE_PARAMS)
APPEND_LAYOUT = compute_layout(APPEND_PARAMS)
BWD_LAYOUT = compute_layout(BWD_PARAMS)
BWD_ROW_LAYOUT = compute_layout(BWD_ROW_PARAMS)
# Struct name on the device -> layout; rendered into flash_params.cuh in this order.
LAYOUTS = {
    "FwdParams": FWD_LAYOUT,
    "CombineParams": COMBINE_LAYOUT,
    "AppendParams": APPEND_LAYOUT,
    "BwdParams": BWD_LAYOUT,
    "BwdRowParams": BWD_ROW_LAYOUT,
}
_STRUCTS = {id(layout): struct.Struct(layout.fmt) for layout in LAYOUTS.values()}
# Per layout: the field values in order, read from the dict in one C call, and the positions of the
# divmod fields, which expand to three struct items each (pack runs on every launch).
_GETTERS = {
    id(layout): (operator.itemgetter(*(f.name for f in layout.fields)),
                 tuple(i for i, f in reversed(list(enumerate(layout.fields))) if f.kind == "divmod"))
    for layout in LAYOUTS.values()
}


def fast_divmod(divisor: int) -> tuple[int, int, int]:
    """(divisor, multiplier, shift) with q = (umulhi(n, multiplier) + n) >> shift == n // divisor
    for 0 <= n < 2**31 (round-up method; exact for every divisor in [1, 2**31))."""
    if not 1 <= divisor < 2**31:
        raise ValueError(f"divisor must be in [1, 2**31), got {divisor}")
    shift = (divisor - 1).bit_length()  # ceil(log2(divisor))
    multiplier = ((1 << 32) * ((1 << shift) - divisor)) // divisor + 1
    return divisor, multiplier, shift


_fast_divmod_cached = functools.lru_cache(maxsize=256)(fast_divmod)


def fast_div(n: int, divmod_value: tuple[int, int, int]) -> int:
    """Host emulation of the device's FastDivmod::div (for tests)."""
    _, multiplier, shift = divmod_value
    return (((n * multiplier) >> 32) + n) >> shift


def pack(layout: Layout, values: dict) -> bytes:
    """Pack a Params instance by field name. A divmod field takes a (divisor, multiplier, shift)
    tuple or a plain divisor."""
    getter, divmod_positions = _GETTERS[id(layout)]
    flat = list(getter(values))
    for i in divmod_positions:  # last first, so earlier positions stay valid
        v = flat[i]
        flat[i:i + 1] = _fast_divmod_cached(v) if isinstance(v, int) else v
    return _STRUCTS[id(layout)].pack(*flat)


def pack_fwd(values: dict) -> bytes:
    return pack(FWD_LAYOUT, values)


def render_struct(name: str, layout: Layout) -> str:
    """The device struct plus a static_assert per offset and one for the size."""
    lines = [f"struct {name} {{"]
    for f in layout.fields:
        ctype = _KINDS[f.kind][0]
        comment = f"  // {f.doc}" if f.doc else ""
        lines.append(f"    {ctype} {f.name};{comment}")
    lines.append("};")
    lines.append(f"static_assert(sizeof({name}) == {layout.size}, \"Params size drift\");")
    # NVRTC 13.0 does not know __builtin_offsetof; the CI compiler (13.5+) checks every offset.
    lines.append("#if __CUDACC_VER_MAJOR__ * 100 + __CUDACC_VER_MINOR__ >= 1305")
    for f, off in zip(layout.fields, layout.offsets):
        lines.append(f"static_assert(__builtin_offsetof({name}, {f.name}) == {off}, \"Params layout drift: {f.name}\");")
    lines.append("#endif")
    return "\n".join(lines)


def pack_fwd_values(*, q_strides, k_strides, v_strides, o_strides, qhead_per_khead: int, page_size: int = 1,
                    **scalars) -> bytes:
    """Pack the forward Params from tensor strides (batch, row, head, ...) and scalar fields."""
    values = scalars
    for prefix, strides in (("q", q_strides), ("k", k_strides), ("v", v_strides), ("o", o_strides)):
        values[f"{prefix}_batch_stride"] = strides[0]
        values[f"{prefix}_row_stride"] = strides[1]
        values[f"{prefix}_head_stride"] = strides[2]
    values["qhead_per_khead"] = qhead_per_khead
    values["page_size"] = page_size
    return pack(FWD_LAYOUT, values)
