"""The one definition of the kernel Params struct.

FWD_PARAMS below is the only place its fields are listed. From it come
  * the device struct (rendered into ``flash_params.cuh``, with a static_assert on every offset and
    on the size, so any NVRTC compile proves the device layout equals the host layout), and
  * the host packing: one precompiled ``struct.Struct`` (a single ``pack_into`` per launch).
"""
from __future__ import annotations

import dataclasses
import functools
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
    Field("q_ptr", "ptr", "query (batch, seqlen_q, nheads, d)"),
    Field("k_ptr", "ptr", "key (batch, seqlen_k, nheads_k, d)"),
    Field("v_ptr", "ptr", "value (batch, seqlen_k, nheads_k, d)"),
    Field("o_ptr", "ptr", "output, same layout as q"),
    Field("lse_ptr", "ptr", "float softmax_lse (batch, nheads, seqlen_q), natural log"),
    Field("alibi_slopes_ptr", "ptr", "float ALiBi slopes (batch?, nheads), or null"),
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
    Field("batch", "i32", ""),
    Field("seqlen_q", "i32", ""),
    Field("seqlen_k", "i32", ""),
    Field("nheads", "i32", "query heads"),
    Field("nheads_k", "i32", "key/value heads"),
    Field("head_dim", "i32", "actual head dim (<= the instance's), a multiple of 8"),
    Field("window_left", "i32", "local: keys visible left of the diagonal (>= 0)"),
    Field("window_right", "i32", "causal/local: keys visible right of the diagonal (>= 0)"),
    Field("qhead_per_khead", "divmod", "nheads / nheads_k"),
    Field("scale_log2", "f32", "log2(e) times the scale of the scores the softmax sees"),
    Field("softmax_scale", "f32", ""),
    Field("softcap_scale", "f32", "softmax_scale / softcap"),
    Field("softcap", "f32", "0 when off"),
    Field("alibi_scale", "f32", "ALiBi slope multiplier into score units"),
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
_FWD_STRUCT = struct.Struct(FWD_LAYOUT.fmt)
assert _FWD_STRUCT.size == FWD_LAYOUT.size
FWD_FIELD_NAMES = tuple(f.name for f in FWD_PARAMS)


def fast_divmod(divisor: int) -> tuple[int, int, int]:
    """(divisor, multiplier, shift) with q = (umulhi(n, multiplier) + n) >> shift == n // divisor
    for 0 <= n < 2**31 (round-up method; exact for every divisor in [1, 2**31))."""
    if not 1 <= divisor < 2**31:
        raise ValueError(f"divisor must be in [1, 2**31), got {divisor}")
    shift = (divisor - 1).bit_length()  # ceil(log2(divisor))
    multiplier = ((1 << 32) * ((1 << shift) - divisor)) // divisor + 1
    return divisor, multiplier, shift


def fast_div(n: int, divmod_value: tuple[int, int, int]) -> int:
    """Host emulation of the device's FastDivmod::div (for tests)."""
    _, multiplier, shift = divmod_value
    return (((n * multiplier) >> 32) + n) >> shift


def pack_fwd(values: dict) -> bytes:
    """Pack a Params instance. Values are flat; a divmod field takes a 3-tuple."""
    flat = []
    for f in FWD_PARAMS:
        v = values[f.name]
        if f.kind == "divmod":
            flat.extend(v)
        else:
            flat.append(v)
    return _FWD_STRUCT.pack(*flat)


def pack_fwd_into(buffer, values: Sequence) -> None:
    """Hot-path packing: ``values`` already flat, in FWD_PARAMS order (divmod fields expanded)."""
    _FWD_STRUCT.pack_into(buffer, 0, *values)


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


_fast_divmod_cached = functools.lru_cache(maxsize=256)(fast_divmod)


def pack_fwd_values(*, q_strides, k_strides, v_strides, o_strides, qhead_per_khead: int, **scalars) -> bytes:
    """Pack the forward Params from tensor strides (batch, row, head, ...) and scalar fields."""
    values = scalars
    for prefix, strides in (("q", q_strides), ("k", k_strides), ("v", v_strides), ("o", o_strides)):
        values[f"{prefix}_batch_stride"] = strides[0]
        values[f"{prefix}_row_stride"] = strides[1]
        values[f"{prefix}_head_stride"] = strides[2]
    values["qhead_per_khead"] = _fast_divmod_cached(qhead_per_khead)
    return pack_fwd(values)
