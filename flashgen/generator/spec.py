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

Run-time (in the Params struct) and why: ALiBi (one uniform branch per score tile; the slopes
pointer is null when off, so it costs nothing measurable and halves the instance count), the
actual head dim below the instance's (predicated, zero-filled chunk loads), sequence lengths,
window sizes, scales and strides.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

DIRECTIONS = ("fwd",)
DTYPES = ("fp16", "bf16")
HEAD_DIMS = (64, 96, 128, 192, 256)
MASKS = ("none", "causal", "local")
FAMILIES = ("sm80",)

Direction = Literal["fwd"]
DType = Literal["fp16", "bf16"]
Mask = Literal["none", "causal", "local"]


@dataclasses.dataclass(frozen=True, order=True)
class KernelSpec:
    """One kernel instance. Field order is the URI's field order."""

    direction: Direction
    family: str          # kernel family (template set): "sm80"
    arch: str            # NVRTC target, e.g. "sm_80", "sm_86", "sm_90a"
    dtype: DType
    head_dim: int
    mask: Mask = "none"
    softcap: bool = False
    pack_gqa: bool = False

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim!r}")
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}")
        if not self.arch.startswith("sm_"):
            raise ValueError(f"arch must look like 'sm_80' or 'sm_90a', got {self.arch!r}")

    @property
    def uri(self) -> str:
        """Readable, unique name: fixed field order, flags appear only when on."""
        parts = [f"flash_{self.direction}", self.family, f"hdim{self.head_dim}", self.dtype]
        if self.mask != "none":
            parts.append(self.mask)
        if self.softcap:
            parts.append("softcap")
        if self.pack_gqa:
            parts.append("packgqa")
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
