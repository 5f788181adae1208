"""The one tile-size table. Templates get their tile constants from here, and so do the host
heuristics (PackGQA efficiency, grid sizes, shared-memory requests).
"""
from __future__ import annotations

import dataclasses

# Largest dynamic shared memory one block may use, per NVRTC target (bytes).
_SMEM_LIMIT = {
    "sm_80": 163 * 1024,
    "sm_86": 99 * 1024,
    "sm_87": 163 * 1024,
    "sm_89": 99 * 1024,
    "sm_90": 227 * 1024,
    "sm_90a": 227 * 1024,
    "sm_100a": 227 * 1024,
    "sm_120": 99 * 1024,
}

# Head-dim rows (Q, K, V, dO tiles) are unpadded in shared memory, their 16-byte chunks swizzled
# (SwizzledRows in fwd_sm80.cuh). The backward's dSᵀ tile pads its rows by 8 elements (16 bytes):
# with an odd number of 16-byte chunks per row, the 8 rows one ldmatrix phase reads fall into 8
# different bank groups.
SMEM_ROW_PAD = 8
ELEMENT_BYTES = 2  # fp16 and bf16
# Shared memory the hardware keeps per resident CTA (1 KB on sm_80 and newer): an SM of S bytes holds
# n CTAs of B bytes each when n * (B + SMEM_PER_CTA_RESERVED) <= S.
SMEM_PER_CTA_RESERVED = 1024


def smem_limit(arch: str) -> int:
    try:
        return _SMEM_LIMIT[arch]
    except KeyError:
        raise ValueError(f"no shared-memory limit known for arch {arch!r}; known: {sorted(_SMEM_LIMIT)}") from None


@dataclasses.dataclass(frozen=True)
class FwdTile:
    block_m: int     # query rows per CTA
    block_n: int     # key rows per main-loop step
    num_warps: int   # all warps: warps_n of them share each key block, the rest split the rows
    kv_buffers: int = 2  # block_n-row buffers that K and V blocks take in turn (kKVBuffers in fwd_sm80.cuh)
    warps_n: int = 1  # warps splitting each key block (see kWarpsN in fwd_sm80.cuh)

    def __post_init__(self):
        warps_m = self.num_warps // self.warps_n
        if warps_m * self.warps_n != self.num_warps or self.block_m // warps_m not in (16, 32) \
                or self.block_m % warps_m or (self.block_n // self.warps_n) % 16 or self.block_n % self.warps_n:
            raise ValueError(f"{self}: each warp must own 16 or 32 rows and a multiple of 16 keys")
        if self.kv_buffers < 2:
            raise ValueError(f"{self}: K and V need a buffer each")

    @property
    def num_threads(self) -> int:
        return self.num_warps * 32

    def smem_bytes(self, head_dim: int) -> int:
        """Q tile + kv_buffers key-block buffers, unpadded rows (swizzled, see SwizzledRows)."""
        return (self.block_m + self.block_n * self.kv_buffers) * head_dim * ELEMENT_BYTES

    def ctas_per_sm(self, head_dim: int, smem_per_sm: int) -> int:
        """CTAs one SM holds at once: by shared memory (SMEM_PER_CTA_RESERVED each) and by registers
        (the kernels use up to 255 per thread, 64K per SM); at most 32."""
        by_smem = smem_per_sm // (self.smem_bytes(head_dim) + SMEM_PER_CTA_RESERVED)
        by_registers = 65536 // (self.num_threads * 256)
        return max(1, min(by_smem, by_registers, 32))


# (head_dim) -> tile, for targets with >= 163 KB of shared memory per block (A100, H100/H200).
# 4 warps win everywhere; above d128 one m16 row tile per warp (64-row CTAs) keeps registers free
# (measurements: benchmarks/results/tuning_history_h200.md).
_FWD_SM80_LARGE = {
    64: FwdTile(128, 128, 4),
    96: FwdTile(128, 64, 4),
    128: FwdTile(128, 64, 4),
    192: FwdTile(64, 64, 4),
    256: FwdTile(64, 64, 4),
}
# Under a causal/local mask, narrower key blocks waste less work on the diagonal.
_FWD_SM80_LARGE_MASKED = {**_FWD_SM80_LARGE, 64: FwdTile(128, 64, 4)}
# For targets with 99 KB (sm_86, sm_89, sm_120).
_FWD_SM80_SMALL = {
    64: FwdTile(128, 64, 4),
    96: FwdTile(128, 64, 4),
    128: FwdTile(128, 64, 4),
    192: FwdTile(64, 64, 4),
    256: FwdTile(64, 32, 4),
}


# Decode: few query rows (<= DECODE_MAX_ROWS after PackGQA). One 16-row tile whose four warps split
# each 128-key block (32 keys each, merged at the end) with a ring of K/V buffers in flight: such
# calls are bound by reading K/V, and more rows per tile would spend the tensor cores on padding
# (measurements: benchmarks/results/tuning_history_h200.md).
FWD_DECODE_TILE = FwdTile(16, 128, 4, kv_buffers=4, warps_n=4)
# Up to this many rows take the decode tile (in two row blocks if it holds 16: their K/V reads
# then coincide in L2); more rows have enough work for the prefill tile.
DECODE_MAX_ROWS = 32
# The shallowest ring worth two decode CTAs per SM: with three buffers one block's K and V are in
# flight while the math reads the third; four buffers and one CTA per SM lose where the clusters of
# splits do not all fit at once (measurements: benchmarks/results/tuning_history_h200.md).
DECODE_MIN_SHARED_RING = 3
# The deepest ring two decode CTAs per SM take where it fits (deeper than FWD_DECODE_TILE's, which
# one CTA alone holds): six buffers beat four at d64; one CTA per SM gains nothing from six
# (measurements: benchmarks/results/tuning_history_h200.md).
DECODE_MAX_SHARED_RING = 6
# Whether paged caches take that ring too (an odd ring: K and V blocks in turn, each block's
# page-table loads issued after the previous block's V copy; an even one still keeps K and V in
# pairs) instead of the deepest ring of pairs one CTA holds. Off: with small pages the ring only
# pays with two CTAs on every SM, and costs smaller grids much more
# (measurements: benchmarks/results/tuning_history_h200.md).
DECODE_PAGED_SHARED_RING = False


def decode_tile(arch: str, head_dim: int, paged: bool = False) -> FwdTile:
    """FWD_DECODE_TILE's ring for the target. Contiguous caches take the deepest ring of
    DECODE_MIN_SHARED_RING to DECODE_MAX_SHARED_RING buffers with which two CTAs share an SM.
    Otherwise (and for paged caches, whose instances keep K and V of a block together, in pairs of
    buffers) the deepest ring of up to FWD_DECODE_TILE's buffers one CTA holds: copies in flight
    matter more than block size, so the key block is halved (each warp keeping >= 16 keys) before
    the ring is cut below four buffers."""
    base = FWD_DECODE_TILE
    limit = smem_limit(arch)
    if not paged or DECODE_PAGED_SHARED_RING:
        pair_limit = (limit + SMEM_PER_CTA_RESERVED) // 2 - SMEM_PER_CTA_RESERVED
        for buffers in range(max(base.kv_buffers, DECODE_MAX_SHARED_RING), DECODE_MIN_SHARED_RING - 1, -1):
            tile = dataclasses.replace(base, kv_buffers=buffers)
            if tile.smem_bytes(head_dim) <= pair_limit:
                return tile
    block_sizes = [base.block_n >> i for i in range(8) if (base.block_n >> i) >= 16 * base.warps_n]
    deepest, step = (base.kv_buffers // 2 * 2, -2) if paged else (base.kv_buffers, -1)
    for min_buffers in (min(4, deepest), 2):
        for block_n in block_sizes:
            for buffers in range(deepest, min_buffers - 1, step):
                tile = dataclasses.replace(base, block_n=block_n, kv_buffers=buffers)
                if tile.smem_bytes(head_dim) <= limit:
                    return tile
    raise ValueError(f"no decode tile fits {arch} at head_dim {head_dim}")


SM90_BLOCK_M = 128  # query rows of an sm90 forward tile: two consumer warpgroups of 64 (kBlockM)


class _Sm90Warpgroups:
    """What the sm90 tiles share (Sm90Warpgroups in sm90_common.cuh): a CTA of a producer warpgroup
    and `consumers` consumer warpgroups, alone on its SM, and the registers each keeps after
    setmaxnreg."""
    producer_registers: int
    num_warps: int

    def _check_registers(self) -> None:
        consumer = self.consumer_registers
        if not (24 <= self.producer_registers <= consumer and self.producer_registers % 8 == 0 and consumer % 8 == 0):
            raise ValueError(f"setmaxnreg needs multiples of 8 from 24 to 256: producer {self.producer_registers}, "
                             f"consumers {consumer}")

    @property
    def consumers(self) -> int:
        """Consumer warpgroups (kConsumers): all but the producer."""
        return self.num_warps // 4 - 1

    @property
    def consumer_registers(self) -> int:
        """What each consumer warpgroup gets of the launch's registers once the producer gave its away."""
        return sm90_consumer_registers(self.producer_registers, self.consumers)

    @property
    def num_threads(self) -> int:
        return self.num_warps * 32

    def ctas_per_sm(self, head_dim: int, smem_per_sm: int) -> int:
        return 1


@dataclasses.dataclass(frozen=True)
class Sm90FwdTile(_Sm90Warpgroups):
    """The sm90 forward's CTA (fwd_sm90.cuh): a producer warpgroup and two consumer warpgroups of
    64 query rows each; Q and a ring of `stages` K and V blocks in 128-byte swizzled panels of
    64 head-dim columns."""
    block_n: int     # keys per block (the S = Q·Kᵀ wgmma's N)
    stages: int = 2  # K/V blocks in flight
    overlap: bool = True  # softmax of block j + 1 during block j's P·V (kOverlap in fwd_sm90.cuh)
    # O stored through the tile's last K/V stage, held until the epilogue (kStageO in fwd_sm90.cuh)
    # rather than straight from the accumulators; split instances store fp32 partials directly.
    stage_o: bool = True
    # Registers per thread after setmaxnreg: the producer warpgroup's, and each consumer's, which
    # take the rest of what the launch allocates (168 x 384 for two consumers, 128 x 512 for three).
    producer_registers: int = 24
    block_m: int = SM90_BLOCK_M  # 64 rows per consumer warpgroup

    def __post_init__(self) -> None:
        if self.block_m not in (128, 192):
            raise ValueError(f"{self}: two or three consumer warpgroups of 64 rows")
        self._check_registers()
        if self.stage_o and 2 * self.block_n < self.block_m:
            raise ValueError(f"{self}: O's {self.block_m} rows are staged in one stage's K and V blocks, "
                             f"2 x {self.block_n} rows")

    @property
    def num_warps(self) -> int:
        return 4 * (self.block_m // 64 + 1)

    def smem_bytes(self, head_dim: int) -> int:
        """1 KB to align the swizzle atoms, Q, `stages` K and V blocks, 2 + 4 * stages mbarriers."""
        panels = head_dim // 64
        return 1024 + panels * 128 * (self.block_m + 2 * self.stages * self.block_n) + 8 * (2 + 4 * self.stages)


def sm90_launch_registers(consumers: int = 2) -> int:
    """The per-thread register cap of an sm90 CTA alone on an SM (__launch_bounds__(threads, 1)): 65536
    registers over the threads of its 1 + consumers warpgroups, rounded down to the granule of 8."""
    return 65536 // (128 * (consumers + 1)) // 8 * 8


def sm90_consumer_registers(producer_registers: int, consumers: int = 2) -> int:
    """Registers per thread of each consumer warpgroup once the producer warpgroup of an sm90 CTA
    has given its share down to producer_registers (setmaxnreg)."""
    return ((consumers + 1) * sm90_launch_registers(consumers) - producer_registers) // consumers // 8 * 8

# (head_dim) -> sm90 forward tile: 128-key blocks at d128 (FlashAttention-3's causal d128 choice),
# 96 at d192 (112 spills under softcap) and 64 at d256, so that two stages fit in 227 KB; the P·V
# overlap pays from d128, not at d64. d64: three consumer warpgroups of 64 rows on 128-key blocks
# (1.03x the two-consumer 128 x 256 tile over 1k-16k tokens, 1.10-1.14x at 16k, but 0.92-0.95x at
# 1k causal, where the 192-row blocks pad 1024 rows to 1152; with the overlap 1.01x:
# benchmarks/results/20261207-nvidia-h100-sm90-bwd-source-counters). The producer keeps 24 registers
# (40 is slower at d64/d128; d256's consumers need 240). O goes through shared memory from d128
# (its direct stores took 2.6-5.6 µs a tile); at d64 they take 0.8 µs, and holding a stage until the
# epilogue delays the next tile's second block (0.92-0.94x at s1k) (measurements:
# benchmarks/results/tuning_history_h200.md and 20261202-nvidia-h200-sm90-fwd-epilogue).
_FWD_SM90 = {
    64: Sm90FwdTile(128, overlap=False, stage_o=False, block_m=192),
    128: Sm90FwdTile(128),
    192: Sm90FwdTile(96),
    256: Sm90FwdTile(64),
}


@dataclasses.dataclass(frozen=True)
class Sm90BwdTile(_Sm90Warpgroups):
    """The sm90 backward's CTA (bwd_sm90.cuh): a producer warpgroup and two consumer warpgroups, K and
    V resident, a ring of `stages` Q and dO blocks of block_m queries (with their LSE and D rows),
    two dSᵀ buffers; 128-byte swizzled panels of 64 head-dim columns. block_n 128: 64 keys per
    consumer, all head-dim columns; block_n 64 (split columns): both consumers on the 64 keys, each
    with half the step's queries in Sᵀ and dPᵀ and its share of the 64-column panels in dK, dV and
    dQ (consumer 0 the first half, rounded up), two Pᵀ buffers beside the dSᵀ ones, and the fp32 dQ
    tile in the step's Q and dO panels once dK and dV have read them (no tile of its own); block_n
    96 (query rows): 48 keys per consumer in the queries' domain (S, dP with the step's 64 queries
    as M; dKᵀ, dVᵀ with the head dim as M), Pᵀ buffers and dQ in the stage as in split columns."""
    block_m: int     # queries per step: the K of dV and dK
    block_n: int = 128
    stages: int = 2  # Q/dO blocks in flight
    producer_registers: int = 24
    num_warps: int = 12
    # Dropout at block_n 128: producer warps draw each step's keep bits into the stage (kKeepBits in
    # bwd_sm90.cuh), a 32-bit word per consumer thread per 64 queries.
    keep_bits: bool = False

    def __post_init__(self) -> None:
        self._check_registers()
        if self.keep_bits and self.block_n != 128:
            raise ValueError(f"{self}: keep bits are laid out for 64 keys per consumer (block_n 128)")
        if self.block_n not in (64, 96, 128) or self.block_m not in (64, 128):
            raise ValueError(f"{self}: the consumers own 64 keys each (block_n 128), share 64 (block_n 64) or "
                             "own 48 in the queries' domain (block_n 96); dQ = dS·K splits 64 or 128 queries over them")
        if (self.split_columns or self.query_rows) and self.block_m != 64:
            raise ValueError(f"{self}: split columns and query rows take 64-query steps (one dSᵀ panel)")

    @property
    def split_columns(self) -> bool:
        """Both consumers on all the keys, the head-dim columns split between them (kSplitColumns)."""
        return self.block_n == 64

    @property
    def query_rows(self) -> bool:
        """48 keys per consumer with the step's queries as the MMAs' M (kQueryRows)."""
        return self.block_n == 96

    @property
    def dq_in_stage(self) -> bool:
        """The fp32 dQ tile in the step's Q and dO panels (kDQInStage), which the dQ thread then
        releases to the producer; otherwise a tile of its own."""
        return self.split_columns or self.query_rows

    @property
    def d_slices(self) -> int:
        """One CTA per key block holds all head-dim columns (the deterministic semaphores' layout)."""
        return 1

    @property
    def s_mma_width(self) -> int:
        """N of each consumer's Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: the step's queries, or half (split columns);
        query rows: of S = Q·Kᵀ and dP = dO·Vᵀ, its keys."""
        if self.query_rows:
            return self.block_n // 2
        return self.block_m // 2 if self.split_columns else self.block_m

    def dkv_mma_widths(self, head_dim: int) -> tuple[int, int]:
        """N of consumer 0's and consumer 1's dV and dK wgmma: all columns, or (split columns) the
        first half of the 64-column panels, rounded up, and the rest; query rows: of dKᵀ and dVᵀ,
        its keys."""
        if self.query_rows:
            return self.block_n // 2, self.block_n // 2
        if not self.split_columns:
            return head_dim, head_dim
        first = -(-head_dim // 128) * 64
        return first, head_dim - first

    def dq_mma_widths(self, head_dim: int) -> tuple[int, ...]:
        """N of the consumers' dQ wgmma: 64 queries each and all columns (block_m 128), all 64
        queries and half the columns (block_m 64), (split columns) the first half of the 64-column
        panels, rounded up, and the rest; query rows: a panel and half of one each (N 64 and 32)."""
        if self.query_rows:
            return 64, 32
        if self.split_columns:
            first = -(-head_dim // 128) * 64
            return first, head_dim - first
        width = head_dim if self.block_m == 128 else head_dim // 2
        return width, width

    def mma_widths(self, head_dim: int) -> set[int]:
        """Every wgmma N the kernel issues at ``head_dim``."""
        return {self.s_mma_width, *self.dkv_mma_widths(head_dim), *self.dq_mma_widths(head_dim)}

    def smem_bytes(self, head_dim: int) -> int:
        """1 KB to align the swizzle atoms, K, V, per stage Q and dO, two dSᵀ (and, split columns and
        query rows, two Pᵀ) buffers, the fp32 dQ tile unless in the stage, per stage the LSE and D
        rows (and keep bits), 3 + 2 * stages mbarriers (dQ in the stage: 3 + 3 * stages)."""
        panels = head_dim // 64
        keep_bits = self.block_m // 64 * 256 * 4 if self.keep_bits else 0
        transposed_buffers = 4 if self.split_columns or self.query_rows else 2
        dq_tile = 0 if self.dq_in_stage else self.block_m * head_dim * 4
        barriers = 3 + (3 if self.dq_in_stage else 2) * self.stages
        return (1024 + panels * 128 * (2 * self.block_n + 2 * self.stages * self.block_m)
                + transposed_buffers * self.block_n * self.block_m * ELEMENT_BYTES + dq_tile
                + self.stages * (2 * self.block_m * 4 + keep_bits) + 8 * barriers)


# (head_dim) -> sm90 backward tile. At d64 128-query steps (Sᵀ and dPᵀ 64 registers each, dK and
# dV 32), at d128 64 (dK and dV take 64 each); at d256 the consumers split the columns of 64 keys
# (dK and dV up to 64 registers each again); at d192 96 keys in the queries' domain, 48 a consumer
# (1.19x the split columns' 64 keys with three stages: each Q/dO load and dQ reduction serves 1.5x
# the keys; benchmarks/results/20261203-nvidia-h200-sm90-bwd-d192-query-rows). dQ goes through a
# shared tile and TMA reductions (faster than atomics or a bulk copy per row; split columns'
# atomics from registers cost d256 1.77x: benchmarks/results/20261202-nvidia-h200-sm90-bwd-d256).
# A third Q/dO stage paid only where the stage also holds dQ and fits (the split columns' d192:
# 1.06x, benchmarks/results/20261203-nvidia-h200-sm90-bwd-dq-in-stage); at d64/d128 neither it nor
# computing Pᵀ during dPᵀ paid (benchmarks/results/tuning_history_h200.md and
# 20261206-nvidia-h100-sm90-bwd-softmax-passes-det-dropout).
_BWD_SM90 = {
    64: Sm90BwdTile(128),
    128: Sm90BwdTile(64),
    192: Sm90BwdTile(64, block_n=96),
    256: Sm90BwdTile(64, block_n=64),
}


def sm90_mma_widths() -> tuple[int, ...]:
    """The wgmma N the sm90 tiles need: the forward's key blocks (S = Q·Kᵀ) and head dims (O += P·V),
    the backward's Sᵀ and dPᵀ query columns, dV and dK columns and dQ widths."""
    widths = {tile.block_n for tile in _FWD_SM90.values()} | set(_FWD_SM90)
    for head_dim, tile in _BWD_SM90.items():
        widths |= tile.mma_widths(head_dim)
    return tuple(sorted(widths))


def fwd_tile(family: str, arch: str, head_dim: int, mask: str = "none", decode: bool = False,
             dropout: bool = False, paged: bool = False) -> FwdTile:
    if family == "sm90":
        if decode or head_dim not in _FWD_SM90:
            raise ValueError(f"the sm90 family has no forward tile for head_dim {head_dim} (decode={decode})")
        tile = _FWD_SM90[head_dim]
        if dropout:
            # Each 16-key chunk of a row draws a Philox block, and their state does not fit next to
            # the overlap's second S, nor in 256-key blocks: the consumers' block loop spilled 31
            # values at d128 causal with the overlap and 239 at d64 with 256 keys, none without
            # (NVRTC 13.0).
            tile = dataclasses.replace(tile, overlap=False, block_n=min(tile.block_n, 128))
        assert tile.smem_bytes(head_dim) <= smem_limit(arch), (arch, head_dim, tile)
        return tile
    if family != "sm80":
        raise ValueError(f"no forward tile table for family {family!r}")
    if decode:
        table = {head_dim: decode_tile(arch, head_dim, paged)}
    elif smem_limit(arch) < 163 * 1024:
        table = _FWD_SM80_SMALL
    else:
        table = _FWD_SM80_LARGE if mask == "none" else _FWD_SM80_LARGE_MASKED
    tile = table[head_dim]
    assert tile.smem_bytes(head_dim) <= smem_limit(arch), (arch, head_dim, tile)
    return tile


# The row kernels' CTAs hold this many warps. The append gives each (batch, row, head) a warp; the
# backward's (bwd_pre, bwd_post) give a row bwd_row_threads lanes. (The combine picks its own
# geometry: launch_combine in runtime/interface.py.)
ROW_KERNEL_WARPS = 4


def bwd_row_threads(head_dim: int) -> int:
    """Lanes per row of bwd_pre and bwd_post (bwd_rows.cuh's rule): one per 16-byte chunk, rounded
    up to a power of two, at most a warp."""
    chunks, threads = head_dim // 8, 1
    while threads < chunks and threads < 32:
        threads *= 2
    return threads


def bwd_row_grid(rows: int, head_dim: int) -> tuple[int, int, int]:
    """CTAs for bwd_pre and bwd_post over `rows` (batch, query, head) rows."""
    rows_per_cta = ROW_KERNEL_WARPS * (32 // bwd_row_threads(head_dim))
    return (max(1, -(-rows // rows_per_cta)), 1, 1)


@dataclasses.dataclass(frozen=True)
class BwdTile:
    num_warps: int  # in groups over 32 keys each (bwd_sm80.cuh)
    block_m: int    # queries per step
    d_slices: int   # dK/dV/dQ columns split over this many CTAs (accumulators fit in registers)
    stages: int = 1  # Q/dO/LSE/D buffers: with 2, step t + 1's rows load during all of step t
    key_groups: int = 0  # 32-key warp groups (block_n = 32 * key_groups); 0: num_warps / 2
    # dQ rows through a shared fp32 tile and bulk reductions (sm_90 targets, where it fits) instead
    # of 8-byte atomics from the fragments: kDQTile in bwd_sm80.cuh.
    dq_tile: bool = False

    def __post_init__(self):
        if not self.key_groups:
            object.__setattr__(self, "key_groups", self.num_warps // 2)
        warps_per_group = self.num_warps // max(self.key_groups, 1)
        if warps_per_group * self.key_groups != self.num_warps or self.block_m % (16 * warps_per_group):
            raise ValueError(f"{self}: each 32-key group takes num_warps / key_groups warps, which split "
                             "block_m into multiples of 16")

    @property
    def block_n(self) -> int:
        return 32 * self.key_groups

    @property
    def num_threads(self) -> int:
        return self.num_warps * 32

    def smem_bytes(self, head_dim: int) -> int:
        """K, V (block_n rows) and per stage Q, dO (block_m rows), swizzled; the padded Pᵀ and dSᵀ
        tiles; per stage the LSE and D rows; the dQ tile (fp32 rows padded by 8 floats)."""
        rows = (2 * self.block_n + 2 * self.block_m * self.stages) * head_dim * ELEMENT_BYTES
        ds = 2 * self.block_n * (self.block_m + SMEM_ROW_PAD) * ELEMENT_BYTES  # Pᵀ and dSᵀ
        dq = self.block_m * (head_dim // self.d_slices + 8) * 4 if self.dq_tile else 0
        return rows + ds + 2 * self.block_m * 4 * self.stages + dq


# (head_dim) -> backward tile. Up to d128 eight warps own 128 keys in pairs (each Q/dO step and each
# dQ atomic serves twice the keys of a 64-key CTA); at d64 the registers left over hold 128-query
# steps. Above d128 eight warps own 64 keys, four per 32-key group, each with a quarter of the head
# dim for dK/dV (faster than the head dim split over two 4-warp CTAs, which recompute S and dP).
# bwd_tile gives each the most Q/dO stages (up to BWD_MAX_STAGES) that fit the target; on sm_90
# targets the dQ tile (bulk reductions instead of atomics) is worth more than a second Q/dO stage
# (d256 has room for only one of them) (measurements: benchmarks/results/tuning_history_h200.md).
_BWD_SM80_LARGE = {64: BwdTile(8, 128, 1, dq_tile=True), 96: BwdTile(8, 64, 1, dq_tile=True),
                   128: BwdTile(8, 64, 1, dq_tile=True), 192: BwdTile(8, 64, 1, key_groups=2, dq_tile=True),
                   256: BwdTile(8, 64, 1, key_groups=2, dq_tile=True)}
# With 99 KB (no device to tune on): d96 takes four warps so that Pᵀ and dSᵀ fit next to K, V, Q, dO.
_BWD_SM80_SMALL = {64: BwdTile(8, 64, 1), 96: BwdTile(4, 64, 1), 128: BwdTile(4, 64, 1),
                   192: BwdTile(2, 32, 2), 256: BwdTile(2, 32, 2)}
BWD_MAX_STAGES = 2
# Targets with cp.reduce.async.bulk (the sm80 family's dQ tile).
BULK_REDUCTION_ARCHS = ("sm_90", "sm_90a")


def bwd_tile(family: str, arch: str, head_dim: int, dropout: bool = False) -> BwdTile | Sm90BwdTile:
    if family == "sm90":
        if head_dim not in _BWD_SM90:
            raise ValueError(f"the sm90 family has no backward tile for head_dim {head_dim}")
        tile = _BWD_SM90[head_dim]
        if dropout and tile.block_n == 128:
            # Drawn in the consumers, each Philox block was drawn by four warps (one word each).
            # The drawing warps spilled every step with 24 registers; 32 leave the consumers 232.
            tile = dataclasses.replace(tile, keep_bits=True, producer_registers=32)
        assert tile.smem_bytes(head_dim) <= smem_limit(arch), (arch, head_dim, tile)
        return tile
    if family != "sm80":
        raise ValueError(f"no backward tile table for family {family!r}")
    table = _BWD_SM80_LARGE if smem_limit(arch) >= 163 * 1024 else _BWD_SM80_SMALL
    want = table[head_dim]
    # The dQ tile where the table asks for it and the target has bulk reductions, with the most
    # stages that fit next to it; otherwise the atomics.
    dq_tile_options = (True, False) if want.dq_tile and arch in BULK_REDUCTION_ARCHS else (False,)
    for dq_tile in dq_tile_options:
        for stages in range(BWD_MAX_STAGES, 0, -1):
            tile = dataclasses.replace(want, stages=stages, dq_tile=dq_tile)
            if tile.smem_bytes(head_dim) <= smem_limit(arch):
                return tile
    raise AssertionError(f"no backward tile fits {arch} at head_dim {head_dim}")
