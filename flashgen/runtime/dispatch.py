"""Selection: a pure function from a call's arguments and the device to one kernel spec and its
launch geometry. Testable on the CPU; the place where mask and PackGQA decisions are made.
"""
from __future__ import annotations

import dataclasses
import logging

from ..generator import matrix
from ..generator.spec import HEAD_DIMS, KernelSpec
from ..generator.tiles import FwdTile, fwd_tile
from . import heuristics

logger = logging.getLogger("flashgen")

_DTYPE_NAMES = {"torch.float16": "fp16", "torch.bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True)
class FwdPlan:
    spec: KernelSpec
    tile: FwdTile
    grid: tuple[int, int, int]
    window_left: int   # as the kernel sees it: >= 0 (no -1; "infinite" is clamped)
    window_right: int

    @property
    def smem_bytes(self) -> int:
        return self.tile.smem_bytes(self.spec.head_dim)


def instance_head_dim(head_dim: int) -> int:
    """The smallest instance head dim that holds ``head_dim`` (the rest is predicated off)."""
    for d in HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim must be at most {HEAD_DIMS[-1]}, got {head_dim}")


def resolve_mask(causal: bool, window_size: tuple[int, int], seqlen_q: int, seqlen_k: int):
    """flash_attn's mask semantics -> (mask, window_left, window_right) for the kernel.

    Query i sees key j iff i + sk - sq - left <= j <= i + sk - sq + right (bottom-right aligned);
    -1 is infinite; causal means right = 0. An infinite side is clamped to sq + sk, which is
    already past every key, so the literal definition holds for any sizes.
    """
    left, right = window_size
    if causal:
        right = 0
    if left < 0 and right < 0:
        return "none", 0, 0
    horizon = seqlen_q + seqlen_k
    left_eff = horizon if left < 0 else min(left, horizon)
    right_eff = horizon if right < 0 else min(right, horizon)
    if left < 0 and right == 0:
        return "causal", left_eff, 0
    return "local", left_eff, right_eff


def plan_fwd(
    *,
    dtype: str,
    head_dim: int,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    nheads_k: int,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    pack_gqa: bool | None,
    device_capability: tuple[int, int],
    family: str | None = None,
) -> FwdPlan:
    """Choose the forward instance and its grid. ``dtype`` is "fp16"/"bf16" or a torch dtype."""
    dtype = _DTYPE_NAMES.get(str(dtype), dtype)
    arch = matrix.target_arch(*device_capability)
    family = family or matrix.family_for(arch)
    mask, window_left, window_right = resolve_mask(causal, window_size, seqlen_q, seqlen_k)
    d_instance = instance_head_dim(head_dim)
    tile = fwd_tile(family, arch, d_instance, mask)
    cc = device_capability[0] * 10 + device_capability[1]
    if pack_gqa is None:
        pack_gqa = heuristics.get_pack_gqa(cc, nheads, nheads_k, seqlen_q, tile.block_m)
    elif nheads == nheads_k:
        pack_gqa = False  # one head per group: the packed kernel computes the same thing
    spec = KernelSpec("fwd", family, arch, dtype, d_instance, mask, softcap > 0, bool(pack_gqa))
    qhead_per_khead = nheads // nheads_k
    rows = seqlen_q * qhead_per_khead if spec.pack_gqa else seqlen_q
    grid = (
        max(1, -(-rows // tile.block_m)),
        nheads_k if spec.pack_gqa else nheads,
        batch,
    )
    return FwdPlan(spec, tile, grid, window_left, window_right)
