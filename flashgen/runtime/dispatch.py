"""Selection: a pure function from a call's arguments and the device to one kernel spec and its
launch geometry. Testable on the CPU; the place where mask and PackGQA decisions are made.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import typing

from ..generator import matrix
from ..generator import tiles as tile_table
from ..generator.spec import HEAD_DIMS, KernelSpec
from ..generator.tiles import DECODE_MAX_ROWS, BwdTile, FwdTile, Sm90BwdTile, Sm90FwdTile, bwd_tile, fwd_tile
from . import heuristics
from .tuning import DEFAULT as DEFAULT_TUNING
from .tuning import Tuning

logger = logging.getLogger("flashgen")

_DTYPE_NAMES = {"torch.float16": "fp16", "torch.bfloat16": "bf16"}  # by str(dtype): no torch import here


def dtype_name(dtype) -> str:
    """The matrix's name of a torch dtype ("fp16", "bf16"); a name passes through."""
    return _DTYPE_NAMES.get(str(dtype), dtype)


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What the plan needs to know about the GPU (read once per device by the runtime)."""

    capability: tuple[int, int]
    num_sms: int = 132
    l2_bytes: int = 50 * 1024 * 1024
    smem_per_sm: int = 228 * 1024


@dataclasses.dataclass(frozen=True)
class FwdPlan:
    spec: KernelSpec
    tile: FwdTile
    grid: tuple[int, int, int]   # (row blocks, heads, batch * num_splits); sm90: (persistent CTAs, 1, 1)
    num_splits: int
    window_left: int   # as the kernel sees it: >= 0 (no -1; "infinite" is clamped)
    window_right: int
    # Decode split-KV on sm_90+: a tile's splits run as one cluster of (1, 1, num_splits) CTAs and
    # merge through distributed shared memory, without the combine kernel (fwd_sm80.cuh).
    merge_in_cluster: bool = False
    # Launched as a programmatic dependent of the kernel before it on the stream (decode on sm_90+,
    # Tuning.decode_dependent_launch): its CTAs wait in griddepcontrol.wait for that kernel's end.
    dependent_launch: bool = False
    # KV heads each CTA reads: 2 for decode over pairs of adjacent heads (Tuning.decode_paired_head_dims),
    # on the instance of twice the head dim; the grid's heads are then nheads_k / 2.
    kv_head_group: int = 1

    @property
    def smem_bytes(self) -> int:
        return self.tile.smem_bytes(self.spec.head_dim)


MAX_SPLITS = 128
GRID_YZ_LIMIT = 65535  # CUDA's limit on gridDim.y and gridDim.z (heads; batch x splits)


def instance_head_dim(head_dim: int) -> int:
    """The smallest instance head dim that holds ``head_dim`` (the rest is predicated off)."""
    for d in HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim must be at most {HEAD_DIMS[-1]}, got {head_dim}")


@functools.lru_cache(maxsize=None)
def sm90_instance_head_dim(head_dim: int) -> int | None:
    """The sm90 forward instance that serves ``head_dim``: the smallest in matrix.SM90_FWD_HEAD_DIMS
    that holds it (the TMA zero-fills Q's, K's and V's columns past the call's, and run_fwd gives
    the kernel an O padded to the instance's); None above the largest."""
    return next((d for d in matrix.SM90_FWD_HEAD_DIMS if head_dim <= d), None)


def sm90_covers(*, seqlen_k: int, pack_gqa: bool, qhead_per_khead: int, tile_rows: int) -> bool:
    """What the sm90 forward needs of a call, whatever instances exist (the matrix says which do:
    _plan_fwd_sm90 asks it): keys, as with none there is nothing for the TMA to map (the sm80
    kernel writes the zeros and -inf lse), and with PackGQA a group that divides the tile's
    ``tile_rows`` (Q comes in one TMA box of tile_rows / G queries x G heads)."""
    return seqlen_k > 0 and not (pack_gqa and tile_rows % qhead_per_khead)


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


def _call_target(device, dtype, family: str | None, sm90: bool):
    """What plan_fwd and plan_bwd start from: the DeviceInfo, the dtype's name, the arch, whether
    the sm90 family may serve the call (the caller's inputs allow it, ``family`` does not force
    sm80, the arch has it), and the family that serves it otherwise."""
    if not isinstance(device, DeviceInfo):
        device = DeviceInfo(tuple(device))
    arch = matrix.target_arch(*device.capability)
    allow_sm90 = sm90 and family in (None, "sm90") and "sm90" in matrix.families(arch)
    return device, dtype_name(dtype), arch, allow_sm90, matrix.family_for(arch) if family in (None, "sm90") else family


def _splits_with_keys(num_splits: int, n_blocks: int) -> int:
    """A split count clamped to 1 .. min(n_blocks, MAX_SPLITS), then lowered to the splits that get
    key blocks: each takes ceil(n_blocks / num_splits) of them (both forward families), so some
    counts leave the last ones empty (16 blocks in 14 splits: 8 of 2 blocks, 6 empty). Same work
    per CTA, fewer CTAs and partials to combine."""
    num_splits = max(1, min(num_splits, n_blocks, MAX_SPLITS))
    return -(-n_blocks // -(-n_blocks // num_splits))


def pack_gqa_for(*, nheads: int, nheads_k: int, pack_gqa: bool | None, cc: int, seqlen_q: int, block_m: int,
                 varlen: bool, paged: bool, num_splits: int, sm90_rows: int = 0, dropout: bool = False,
                 masked_sm90: bool = False) -> bool:
    """Whether a forward call packs the query heads of a KV head into its tiles' rows (PackGQA).

    MHA never packs (one head per group: the packed kernel computes the same thing). An explicit
    ``pack_gqa`` wins. Otherwise the heuristic (heuristics.get_pack_gqa: always below sm_90, with
    paged K/V and with split-KV, else where packing fills ``block_m``-row tiles better), and always
    where the unpacked query heads would not fit gridDim.y. ``num_splits`` is the split count as
    far as known: the caller's (0: the heuristic's, not chosen yet), then the chosen one, so that a
    split-KV plan packs. The sm90 family (``sm90_rows``: its tile's rows for the call, 0 for the
    sm80 family) takes the heuristic's packing only for a group that divides them and without
    dropout (no packed dropout instance); an explicit
    pack_gqa=True that it cannot serve goes to the sm80 family. ``masked_sm90``: a causal or local
    call under Tuning.sm90_pack_gqa_masked, which the sm90 family packs whatever the fill heuristic
    says. (Decode over a pair of KV heads, FwdPlan.kv_head_group, packs their rows whatever this
    says, unless pack_gqa is False.)"""
    if nheads == nheads_k:
        return False
    if pack_gqa is not None:
        return bool(pack_gqa)
    pack = heuristics.get_pack_gqa(
        cc, nheads, nheads_k, seqlen_q, block_m, varlen_q=varlen, paged_kv_without_tma=paged, num_splits=num_splits,
    ) or nheads > GRID_YZ_LIMIT
    if sm90_rows:
        return (pack or masked_sm90) and sm90_rows % (nheads // nheads_k) == 0 and not dropout
    return pack


def _is_decode(rows: int, dropout: bool) -> bool:
    """Whether the sm80 family takes its decode tile for a row block of ``rows`` (packed) rows."""
    return rows <= DECODE_MAX_ROWS and not dropout


class _FwdCall(typing.NamedTuple):  # (a tuple: quicker to build than a frozen dataclass)
    """plan_fwd's arguments, resolved: what the family planners read."""

    dtype: str           # the matrix's name
    arch: str
    family: str          # the family that serves the call off the sm90 family
    cc: int              # compute capability as 80, 86, 90
    device: DeviceInfo
    head_dim: int
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    mask: str
    window_left: int
    window_right: int
    softcap: float
    pack_gqa: bool | None
    paged: bool
    page_size: int
    leftpad: bool
    varlen: bool
    varlen_uniform: bool
    dropout: bool
    kv_heads_adjacent: bool

    @property
    def qhead_per_khead(self) -> int:
        return self.nheads // self.nheads_k


@functools.lru_cache(maxsize=4096)
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
    device: DeviceInfo | tuple[int, int],
    paged: bool = False,
    num_splits: int = 1,
    family: str | None = None,
    varlen: bool = False,
    varlen_uniform: bool = False,
    dropout: bool = False,
    sm90: bool = False,
    page_size: int = 0,
    leftpad: bool = False,
    kv_heads_adjacent: bool = False,
    tuning: Tuning = DEFAULT_TUNING,
) -> FwdPlan:
    """Choose the forward instance, its grid and the split count. A pure function of hashable
    arguments, memoized: a call shape seen before costs one dictionary lookup.

    ``dtype`` is "fp16"/"bf16" or a torch dtype; ``seqlen_k`` is the key count, or for a KV cache
    its capacity; ``num_splits``: 1 none, 0 heuristic, N forced (clamped to the key blocks and
    MAX_SPLITS); ``varlen``: seqlen_q / seqlen_k are the longest sequences of a variable-length batch;
    ``varlen_uniform``: and every sequence is that long (the tensors hold batch x longest rows);
    ``dropout``: the instance with the Philox mask (never paged, never the decode tile);
    ``page_size``, ``leftpad``: a paged cache's rows per page and whether keys start past a left
    pad (the sm90 forward's TMA takes pages of whole key blocks without a left pad; the rest its
    gather instances);
    ``kv_heads_adjacent``: K's and V's heads are head_dim elements apart (decode may then read
    two per CTA: Tuning.decode_paired_head_dims);
    ``tuning``: the knobs (runtime/tuning.py; the runtime passes tuning.current());
    ``sm90``: the caller's inputs allow the sm90 forward (tensors the TMA can read). On
    sm_90a such a call takes the sm90 family where it has an instance for it (sm90_covers and the
    matrix: _plan_fwd_sm90), unless ``family`` forces sm80; everything else runs the sm80 family.
    PackGQA: pack_gqa_for.
    """
    device, dtype, arch, allow_sm90, family = _call_target(device, dtype, family, sm90)
    mask, window_left, window_right = resolve_mask(causal, window_size, seqlen_q, seqlen_k)
    call = _FwdCall(
        dtype=dtype, arch=arch, family=family, cc=device.capability[0] * 10 + device.capability[1], device=device,
        head_dim=head_dim, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_k=nheads_k,
        mask=mask, window_left=window_left, window_right=window_right, softcap=softcap, pack_gqa=pack_gqa,
        paged=paged, page_size=page_size, leftpad=leftpad, varlen=varlen, varlen_uniform=varlen_uniform,
        dropout=dropout, kv_heads_adjacent=kv_heads_adjacent,
    )
    d_instance = instance_head_dim(head_dim)
    group = call.qhead_per_khead
    # Both families' packing is judged by the fill of the sm80 family's prefill tile.
    pack_rule = functools.partial(
        pack_gqa_for, nheads=nheads, nheads_k=nheads_k, pack_gqa=pack_gqa, cc=call.cc, seqlen_q=seqlen_q,
        block_m=fwd_tile(family, arch, d_instance, mask).block_m, varlen=varlen, paged=paged,
    )
    pack = pack_rule(num_splits=num_splits)
    if dropout and paged:
        raise ValueError("dropout_p must be 0 with a paged K/V cache (no paged dropout instance)")
    sm90_tile = _sm90_fwd_tile(call) if allow_sm90 else None
    if sm90_tile is not None:
        # Calls the sm80 family would run on its decode tile stay there (the sm90 family has none).
        decode = _is_decode(seqlen_q * group if pack else seqlen_q, dropout)
        sm90_pack = pack_rule(num_splits=num_splits, sm90_rows=sm90_tile.block_m, dropout=dropout,
                              masked_sm90=tuning.sm90_pack_gqa_masked and mask != "none")
        sm90_plan = _plan_fwd_sm90(call, sm90_tile, sm90_pack, decode, num_splits)
        if sm90_plan is not None:
            return sm90_plan
    geometry = _sm80_geometry(call, pack, tuning)
    splits = _sm80_num_splits(call, geometry, num_splits, tuning)
    if not geometry.pack and pack_rule(num_splits=splits):
        # Split-KV packs GQA heads: the packed geometry with the count chosen unpacked (more than
        # one, so not chosen again: only clamped to the packed tile's key blocks).
        geometry = _sm80_geometry(call, True, tuning)
        splits = _sm80_num_splits(call, geometry, splits, tuning)
    return _sm80_plan(call, geometry, splits, tuning)


class _Sm80Geometry(typing.NamedTuple):
    """The sm80 forward's tile and grid for a call at one PackGQA choice, before the split count."""

    pack: bool           # the choice, or packed for a pair of KV heads
    decode: bool
    kv_head_group: int   # FwdPlan.kv_head_group
    head_dim: int        # the instance's
    tile: FwdTile
    heads: int           # gridDim.y
    m_blocks: int
    n_blocks: int
    cta_slots: int       # CTAs the GPU holds at once
    ctas_per_sm: int
    cluster_merge: bool  # decode splits may merge in a cluster (FwdPlan.merge_in_cluster)


def _sm80_geometry(call: _FwdCall, pack: bool, tuning: Tuning) -> _Sm80Geometry:
    """The sm80 forward's tile and grid for ``call`` with or without PackGQA (``pack``)."""
    group = call.qhead_per_khead
    rows = call.seqlen_q * group if pack else call.seqlen_q
    decode = _is_decode(rows, call.dropout)
    d_instance = instance_head_dim(call.head_dim)
    # Decode over pairs of adjacent KV heads: the packed rows of both fit one decode row block.
    kv_head_group = 2 if (
        decode and call.kv_heads_adjacent and call.head_dim in tuning.decode_paired_head_dims
        and 2 * call.head_dim in HEAD_DIMS and call.nheads_k % 2 == 0 and call.pack_gqa is not False
        and 2 * call.seqlen_q * group <= tile_table.FWD_DECODE_TILE.block_m
        and call.batch * call.nheads_k // 2 >= tuning.decode_pair_min_sm_share * call.device.num_sms
    ) else 1
    if kv_head_group > 1:
        pack, d_instance = True, kv_head_group * call.head_dim
        rows = call.seqlen_q * group * kv_head_group
    tile = fwd_tile(call.family, call.arch, d_instance, call.mask, decode, paged=call.paged)
    ctas_per_sm = tile.ctas_per_sm(d_instance, call.device.smem_per_sm)
    return _Sm80Geometry(
        pack, decode, kv_head_group, d_instance, tile,
        heads=call.nheads_k // kv_head_group if pack else call.nheads,
        m_blocks=max(1, -(-rows // tile.block_m)),
        n_blocks=max(1, -(-call.seqlen_k // tile.block_n)),
        cta_slots=call.device.num_sms * ctas_per_sm,
        ctas_per_sm=ctas_per_sm,
        # (Varlen calls keep the combine: it writes the zeros of rows past seqused_q.)
        cluster_merge=tuning.merge_in_cluster and decode and call.cc >= 90 and not call.varlen,
    )


def _clusters_merge(call: _FwdCall, g: _Sm80Geometry, splits: int, tuning: Tuning) -> bool:
    """Whether ``splits`` splits of each tile merge in a cluster rather than through the combine."""
    grid = g.m_blocks * g.heads * call.batch * splits
    short_splits = -(-g.n_blocks // splits) <= tuning.cluster_max_split_blocks(g.head_dim)
    return grid <= tuning.decode_cluster_max_fill * g.cta_slots and (
        splits <= 2 or short_splits or 2 * grid <= call.device.num_sms)


def _sm80_num_splits(call: _FwdCall, g: _Sm80Geometry, num_splits: int, tuning: Tuning) -> int:
    """The sm80 forward's split count: ``num_splits`` as plan_fwd takes it (0: the heuristic's)."""
    if num_splits == 0:
        total_mblocks = g.m_blocks * g.heads * call.batch
        max_splits = min(MAX_SPLITS, max(1, GRID_YZ_LIMIT // call.batch))
        slots = call.device.num_sms * min(tuning.decode_split_ctas_per_sm, g.ctas_per_sm) if g.decode else g.cta_slots
        num_splits = heuristics.num_splits_heuristic(
            total_mblocks, slots, g.n_blocks, g.m_blocks,
            call.seqlen_k * call.head_dim * g.kv_head_group * 2 * 2, call.mask != "none", max_splits,
            l2_bytes=call.device.l2_bytes,
        )
        if g.decode and tuning.decode_fill_wave and num_splits > 1 and total_mblocks * num_splits < slots:
            filled = min(slots // total_mblocks, max_splits)
            if g.n_blocks // max(filled, 1) >= tuning.decode_fill_min_blocks:
                num_splits = max(num_splits, filled)
        if g.cluster_merge and num_splits > tuning.decode_cluster_splits \
                and g.n_blocks <= tuning.decode_cluster_max_blocks \
                and _clusters_merge(call, g, tuning.decode_cluster_splits, tuning):
            num_splits = tuning.decode_cluster_splits
    return _splits_with_keys(num_splits, g.n_blocks)


def _sm80_plan(call: _FwdCall, g: _Sm80Geometry, num_splits: int, tuning: Tuning) -> FwdPlan:
    spec = KernelSpec("fwd", call.family, call.arch, call.dtype, g.head_dim, call.mask, call.softcap > 0, g.pack,
                      call.paged, g.decode, call.dropout)
    grid = (g.m_blocks, g.heads, call.batch * num_splits)
    merge_in_cluster = g.cluster_merge and 1 < num_splits <= tuning.decode_cluster_splits \
        and _clusters_merge(call, g, num_splits, tuning)
    ctas = grid[0] * grid[1] * grid[2]
    dependent = g.decode and call.cc >= 90 and tuning.decode_dependent_launch and (
        ctas <= tuning.decode_dependent_max_sm_share * call.device.num_sms or ctas > g.cta_slots)
    return FwdPlan(spec, g.tile, grid, num_splits, call.window_left, call.window_right, merge_in_cluster, dependent,
                   g.kv_head_group)


def _sm90_fwd_tile(call: _FwdCall) -> Sm90FwdTile | None:
    """The sm90 forward tile of the instance that would serve the call; None above its head dims."""
    sm90_head_dim = sm90_instance_head_dim(call.head_dim)
    return None if sm90_head_dim is None else fwd_tile("sm90", call.arch, sm90_head_dim, dropout=call.dropout)


def _plan_fwd_sm90(call: _FwdCall, tile: Sm90FwdTile, pack: bool, decode: bool, num_splits: int) -> FwdPlan | None:
    """plan_fwd on the sm90 family with ``tile`` (_sm90_fwd_tile), or None where it does not serve
    the call: what the call needs of it (sm90_covers), an instance in the matrix for the call and
    its split count (dropout: unsplit only), and the kernel's 32-bit counters. The sm80 family
    serves the rest. ``pack``: pack_gqa_for's sm90 choice; ``decode``: the sm80 family would take
    its decode tile; ``num_splits`` as plan_fwd takes it."""
    if not sm90_covers(seqlen_k=call.seqlen_k, pack_gqa=pack, qhead_per_khead=call.qhead_per_khead,
                       tile_rows=tile.block_m):
        return None
    sm90_head_dim = sm90_instance_head_dim(call.head_dim)
    # Pages that split the tile's key blocks (or an unknown page size), or keys shifted by a left
    # pad: the gather instance; pages of whole blocks: the TMA's.
    gather = call.paged and (call.leftpad or call.page_size <= 0 or call.page_size % tile.block_n != 0)

    def instance(split: bool) -> KernelSpec | None:
        return matrix.find_instance("fwd", "sm90", call.arch, call.dtype, sm90_head_dim, call.mask, call.softcap > 0,
                                    pack, call.paged, decode, call.dropout, split=split, gather=gather)

    if instance(split=False) is None:
        return None
    # Persistent: one CTA per SM at most, each looping over work units: (batch, head, row block)
    # tiles, or under the causal mask pairs of row blocks of equal total cost (fwd_sm90.cuh);
    # packed, a tile's rows are the (query, head) pairs of one KV head. With split-KV each tile is
    # num_splits units, one per share of the key blocks.
    group = call.qhead_per_khead if pack else 1
    heads = call.nheads_k if pack else call.nheads
    row_blocks = -(-call.seqlen_q * group // tile.block_m)
    n_blocks = -(-call.seqlen_k // tile.block_n)
    tiles = (-(-row_blocks // 2) if call.mask == "causal" else row_blocks) * heads * call.batch  # units unsplit
    if num_splits == 0 and instance(split=True) is None:
        num_splits = 1  # no split instance (dropout): the heuristic's choice stays on sm90 unsplit
    elif num_splits == 0:  # the CTAs without splits are the units: causal pairs count once
        num_splits = heuristics.num_splits_heuristic(
            tiles, call.device.num_sms, n_blocks, row_blocks,
            call.seqlen_k * call.head_dim * 2 * 2, call.mask != "none", MAX_SPLITS, l2_bytes=call.device.l2_bytes,
        )
    num_splits = _splits_with_keys(num_splits, n_blocks)
    spec = instance(split=num_splits > 1)
    if spec is None:  # a split asked for without a split instance (dropout): the sm80 family splits
        return None
    units = tiles * num_splits
    # Varlen: the units come from the longest sequence, and the lengths are on the device, so a
    # static schedule cannot balance them (a short sequence's units past its end are empty):
    # one CTA per unit, handed out by the hardware as CTAs finish. Sequences all of one length
    # keep the persistent grid, whose K/V loads run ahead into the next unit (H200, bf16: 16 x
    # 1024 tokens 6-11% faster than one CTA per unit; 16 ragged d256 causal 0.61x of it).
    ctas = units if call.varlen and not call.varlen_uniform else min(units, call.device.num_sms)
    # The kernel counts rows, work units and each CTA's next unit (its last + the grid) in
    # 32-bit ints; beyond them (reachable with varlen) the sm80 grid serves.
    if call.seqlen_q * group + tile.block_m >= 2**31 or units + ctas >= 2**31:
        return None
    return FwdPlan(spec, tile, (ctas, 1, 1), num_splits, call.window_left, call.window_right)


@dataclasses.dataclass(frozen=True)
class BwdPlan:
    spec: KernelSpec
    tile: BwdTile | Sm90BwdTile
    grid: tuple[int, int, int]  # (key blocks x head-dim slices, KV heads, batch)
    window_left: int
    window_right: int
    # Deterministic sm90 dQ order (bwd_sm90.cuh): key blocks add to a query block last first when
    # every query head has its own KV head under a causal mask, first first otherwise (MHA causal
    # gains with the former, GQA causal with the latter: benchmarks/results/
    # 20261202-nvidia-h200-sm90-bwd-rows-order and 20261201-nvidia-h200-sm90-bwd-det).
    dq_turns_descending: bool = False
    # The sm90 grid's order (bwd_sm90.cuh's bwd_cta): 0 = launch order, C > 0 = the (batch, KV head)
    # pairs in C even chunks, each run key blocks slowest (Tuning.bwd_causal_chunk_waves, or in
    # deterministic mode Tuning.bwd_det_chunk_l2_share).
    cta_chunks: int = 0

    @property
    def smem_bytes(self) -> int:
        return self.tile.smem_bytes(self.spec.head_dim)


@functools.lru_cache(maxsize=1024)
def plan_bwd(
    *, dtype: str, head_dim: int, batch: int, seqlen_q: int, seqlen_k: int, nheads_k: int,
    causal: bool, window_size: tuple[int, int], softcap: float, device: DeviceInfo | tuple[int, int],
    family: str | None = None, dropout: bool = False, sm90: bool = False, nheads: int | None = None,
    deterministic: bool = False, tuning: Tuning = DEFAULT_TUNING,
) -> BwdPlan:
    """The backward instance and grid for a call (a pure function, like plan_fwd). ``sm90``: the
    caller's inputs allow the sm90 backward (tensors the TMA can read, no seqused); on sm_90a such
    a call takes it when it has an instance (sm90_bwd_instance_head_dim), unless ``family`` forces
    sm80. ``nheads`` (None: as many as ``nheads_k``) and ``deterministic`` choose the
    deterministic dQ order; ``tuning`` the knobs (the runtime passes tuning.current())."""
    device, dtype, arch, allow_sm90, family = _call_target(device, dtype, family, sm90)
    mask, window_left, window_right = resolve_mask(causal, window_size, seqlen_q, seqlen_k)
    sm90_head_dim = sm90_bwd_instance_head_dim(head_dim) if allow_sm90 else None
    if sm90_head_dim is not None:
        tile = bwd_tile("sm90", arch, sm90_head_dim, dropout)
        spec = KernelSpec("bwd", "sm90", arch, dtype, sm90_head_dim, mask, softcap > 0, dropout=dropout)
        descending = deterministic and mask == "causal" and (nheads or nheads_k) == nheads_k
        key_blocks = max(1, -(-seqlen_k // tile.block_n))
        pairs_per_chunk = 0  # 0: launch order
        if deterministic and tuning.bwd_det_chunk_l2_share > 0:
            group = (nheads or nheads_k) // nheads_k
            pair_bytes = group * seqlen_q * head_dim * (2 * 2 + 4)  # Q and dO (16-bit), dQ in fp32
            pairs_per_chunk = max(1, int(tuning.bwd_det_chunk_l2_share * device.l2_bytes // pair_bytes))
        elif not deterministic and mask == "causal" and tuning.bwd_causal_chunk_waves > 0:
            pairs_per_chunk = math.ceil(tuning.bwd_causal_chunk_waves * device.num_sms / key_blocks)
        chunks = max(1, batch * nheads_k // pairs_per_chunk) if pairs_per_chunk else 0
        return BwdPlan(spec, tile, (key_blocks, nheads_k, batch), window_left, window_right,
                       dq_turns_descending=descending, cta_chunks=chunks)
    d_instance = instance_head_dim(head_dim)
    tile = bwd_tile(family, arch, d_instance)
    spec = KernelSpec("bwd", family, arch, dtype, d_instance, mask, softcap > 0, dropout=dropout)
    grid = (max(1, -(-seqlen_k // tile.block_n)) * tile.d_slices, nheads_k, batch)
    return BwdPlan(spec, tile, grid, window_left, window_right)


def sm90_bwd_instance_head_dim(head_dim: int) -> int | None:
    """The sm90 backward instance that serves a call the TMA can read at ``head_dim``: the
    smallest of matrix.SM90_BWD_HEAD_DIMS that holds it (bwd_sm90.cuh: the TMA zero-fills the
    columns past the call's and drops the dQ tile's), None above the largest. Every instance takes
    any mask, softcap or not, ALiBi, GQA, dropout and the deterministic dQ order (its dQ goes
    through a tile and TMA reductions)."""
    return next((d for d in matrix.SM90_BWD_HEAD_DIMS if head_dim <= d), None)
