"""The kernel spec: every compile-time switch of one generated kernel instance.

Which switches are compile-time, and why:

* ``direction``, ``dtype``, ``head_dim`` and ``arch`` change the code itself (types, unrolled
  loop trip counts, tile sizes, instruction set).
* ``mask`` (none / causal / local) changes the loop bounds and whether boundary blocks need a
  masking pass; the unmasked instance carries no masking code at all.  Causal and local stay
  separate so that URIs read the way users think; a causal call never pays for the left edge.
* ``softcap`` adds a transcendental per score; compiled in only where asked for (FlashAttention's
  SOFTCAP_SWITCH).
* ``pack_gqa`` changes the row → (query position, head) mapping of every Q load and O store.
* ``paged`` reads K/V rows through a page table (a divmod and a table load per row); the
  contiguous path keeps its lean addressing and registers.
* ``decode`` picks the tile for few query rows (16 rows, warps splitting the keys, K/V copies in
  flight; see tiles.py): decode-shaped calls are bound by reading K/V, and a 128-row tile would spend
  the tensor cores on padding instead.
* ``dropout`` adds a Philox draw per 4 (forward) or 2 (backward) probabilities of a thread; as a
  run-time branch its registers cost the
  kernels without dropout their spill-free allocation (d64 forward: 0 -> 156 bytes of spills), so
  it is compiled in only where asked for (forward without paging or the decode tile, backward).

Run-time (in the Params struct) and why: split-KV (only the epilogue differs: one uniform branch),
varlen cu_seqlens / seqused and cache_seqlens / cache_batch_idx / leftpad (per-CTA scalars), dropout's
probability and Philox seed/offset (scalars of the dropout instances), ALiBi (one uniform branch per score tile; the slopes
pointer is null when off, so it costs nothing measurable and halves the instance count), the
actual head dim below the instance's (predicated, zero-filled chunk loads), sequence lengths,
window sizes, scales and strides.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

# fwd: attention; append: KV-cache append with rotary (before attention in flash_attn_with_kvcache);
# combine: merges split-KV partials; bwd: the backward main kernel, with bwd_pre (D = rowsum(dO*O))
# and bwd_post (dQ from its fp32 accumulator) around it.
DIRECTIONS = ("fwd", "bwd", "append", "combine", "bwd_pre", "bwd_post")
# Directions whose kernels take the head dim at run time and have no feature switches.
ROW_DIRECTIONS = ("append", "combine", "bwd_pre", "bwd_post")
DTYPES = ("fp16", "bf16")
COMBINE_DTYPES = ("fp16", "bf16", "fp32")  # the combine's output dtype
HEAD_DIMS = (64, 96, 128, 192, 256)
MASKS = ("none", "causal", "local")
# sm80: mma.sync + cp.async, every feature, every target (sm_80, sm_86, sm_90a). sm90: the Hopper
# forward and backward (wgmma + TMA, warp-specialized; fwd_sm90.cuh, bwd_sm90.cuh), sm_90a only, for
# the calls their instances cover (matrix.SM90_FWD_HEAD_DIMS, every mask, softcap, PackGQA, split-KV,
# paged K/V of any page size, dropout unpacked, unsplit and unpaged; no decode tile; the backward:
# head dims up to the largest of matrix.SM90_BWD_HEAD_DIMS,
# dense and varlen calls without seqused, deterministic or not);
# everything else keeps sm80.
FAMILIES = ("sm80", "sm90")

Direction = Literal["fwd", "bwd", "append", "combine", "bwd_pre", "bwd_post"]
DType = Literal["fp16", "bf16", "fp32"]
Mask = Literal["none", "causal", "local"]


@dataclasses.dataclass(frozen=True, order=True)
class KernelSpec:
    """One kernel instance. Field order is the URI's field order."""

    direction: Direction
    family: str          # kernel family (template set): "sm80" or "sm90"
    arch: str            # NVRTC target, e.g. "sm_80", "sm_86", "sm_90a"
    dtype: DType
    head_dim: int = 0    # 0 for kernels that take it at run time
    mask: Mask = "none"
    softcap: bool = False
    pack_gqa: bool = False
    paged: bool = False
    decode: bool = False
    dropout: bool = False
    split: bool = False  # sm90 forward: split-KV partials (the sm80 forward takes num_splits at run time)
    gather: bool = False  # sm90 paged forward: K/V rows gathered by cp.async (pages that split key blocks)

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        dtypes = COMBINE_DTYPES if self.direction == "combine" else DTYPES
        if self.dtype not in dtypes:
            raise ValueError(f"dtype must be one of {dtypes}, got {self.dtype!r}")
        if self.direction in ("fwd", "bwd"):
            if self.head_dim not in HEAD_DIMS:
                raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim!r}")
            if self.mask not in MASKS:
                raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}")
            if self.direction == "bwd" and (self.pack_gqa or self.paged or self.decode):
                raise ValueError(f"the backward has no PackGQA, paged or decode variants: {self}")
            if self.dropout and (self.paged or self.decode):
                raise ValueError(f"dropout is for training: no paged or decode variants: {self}")
            if self.family == "sm90" and self.decode:
                raise ValueError(f"the sm90 family has no decode tile: {self}")
            if self.family == "sm90" and self.dropout and (self.pack_gqa or self.split):
                raise ValueError(f"sm90 dropout instances are unpacked and unsplit: {self}")
            if self.split and (self.family != "sm90" or self.direction != "fwd"):
                raise ValueError(f"split instances are the sm90 forward's: {self}")
            if self.gather and (self.family != "sm90" or self.direction != "fwd" or not self.paged):
                raise ValueError(f"gather instances are the sm90 paged forward's: {self}")
        elif (self.head_dim, self.mask, self.softcap, self.pack_gqa, self.paged, self.decode, self.dropout,
              self.split, self.gather) != (0, "none", False, False, False, False, False, False, False):
            raise ValueError(f"{self.direction} kernels take the head dim at run time and no switches: {self}")
        if not self.arch.startswith("sm_"):
            raise ValueError(f"arch must look like 'sm_80' or 'sm_90a', got {self.arch!r}")

    @property
    def uri(self) -> str:
        """Readable, unique name: fixed field order, flags appear only when on."""
        parts = [f"flash_{self.direction}", self.family]
        if self.head_dim:
            parts.append(f"hdim{self.head_dim}")
        parts.append(self.dtype)
        if self.mask != "none":
            parts.append(self.mask)
        if self.softcap:
            parts.append("softcap")
        if self.pack_gqa:
            parts.append("packgqa")
        if self.paged:
            parts.append("paged")
        if self.decode:
            parts.append("decode")
        if self.dropout:
            parts.append("dropout")
        if self.split:
            parts.append("split")
        if self.gather:
            parts.append("gather")
        parts.append(self.arch.replace("_", ""))
        return "_".join(parts)

    @property
    def kernel_name(self) -> str:
        """The extern "C" entry point inside the rendered instance."""
        return self.uri

    @property
    def compute_capability(self) -> int:
        """80 for sm_80, 90 for sm_90a."""
        return int("".join(ch for ch in self.arch[3:] if ch.isdigit()))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KernelSpec":
        return cls(**data)
