"""The plan's tuning knobs, one frozen value. plan_fwd takes it as an argument (part of its memo
key); the runtime passes ``current()``, which ``use`` changes for the calls inside a block. So a
benchmark or a test runs another tuning by passing one, and no module global is patched. Why each
default: the comments below; the measurements: benchmarks/results/tuning_history_h200.md."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator


@dataclasses.dataclass(frozen=True)
class Tuning:
    # Decode (the decode tile) only reads K/V, and an SM left idle is its share of the bandwidth
    # lost: when the heuristic's splits leave part of the single wave empty, raise them to fill it,
    # as long as each split keeps at least decode_fill_min_blocks key blocks (in shorter ones fixed
    # costs and the combine dominate).
    decode_fill_wave: bool = True
    decode_fill_min_blocks: int = 8
    # Decode splits count one CTA per SM even where two fit (the contiguous decode ring): counting
    # two gives more, shorter splits and the combine kernel, and loses; where two won, one per SM
    # with the combine kernel instead of clusters won more.
    decode_split_ctas_per_sm: int = 1
    # Decode splits of one tile merged in a cluster on sm_90+ (up to the portable cluster size, 8):
    # no partials in global memory and no combine kernel. Where the heuristic wants more splits but
    # keys are few (at most decode_cluster_max_blocks key blocks), 8 merged in a cluster beat them;
    # with more keys the extra splits' bandwidth wins.
    merge_in_cluster: bool = True
    decode_cluster_splits: int = 8
    decode_cluster_max_blocks: int = 64
    # A cluster's CTAs start together, on SMs of one GPC with room for all of them: merged in
    # clusters only while the grid takes at most this share of the CTA slots (SMs x decode CTAs per
    # SM); fuller grids run faster through the combine kernel.
    decode_cluster_max_fill: float = 0.5
    # Clusters of more than two splits pay for short, latency-bound splits (at most this many key
    # blocks each, per instance head dim: d96 merges better through the combine from 3 blocks a
    # split), or grids of at most half the SMs (batch 1); longer splits of larger grids merge through
    # the combine kernel. (head dim, blocks) pairs: a value must be hashable.
    decode_cluster_max_split_blocks: tuple[tuple[int, int], ...] = ((64, 16), (96, 2), (128, 16), (192, 8), (256, 8))
    # Decode forwards on sm_90+ are programmatic dependent launches: their CTAs are scheduled while
    # the previous kernel on the stream finishes its last wave and wait in griddepcontrol.wait for
    # its completion, which hides the launch latency between the two. Only for grids of at most
    # decode_dependent_max_sm_share of the SMs, or of more CTAs than the SMs hold at once: a grid of
    # about one CTA per SM, scheduled while the previous kernel still holds a CTA slot of most SMs,
    # is not spread one per SM.
    decode_dependent_launch: bool = True
    decode_dependent_max_sm_share: float = 0.5
    # Decode whose K/V heads are adjacent in memory (head stride = head_dim, flash_attn's (...,
    # nheads_k, d) layout) reads two heads per CTA at these head dims (FwdPlan.kv_head_group,
    # fwd_sm80.cuh): a key's two rows are then one run of 2 x head_dim elements, read by the
    # instance of twice the head dim, and d96's 192-byte rows no longer share a 128-byte line
    # between two CTAs. Only for grids of at least decode_pair_min_sm_share x SMs paired tiles:
    # smaller ones need twice the splits for the same CTAs, and lose. (A query row's zero columns
    # meet the other head's keys in Q·Kᵀ: a non-finite key of one head, already fatal to that
    # head's rows, then makes the paired head's rows NaN too.)
    decode_paired_head_dims: frozenset[int] = frozenset({64, 96})
    decode_pair_min_sm_share: float = 0.5
    # The split-KV combine as a programmatic dependent launch on sm_90+ (execute.launch_combine).
    dependent_combine: bool = True
    # The sm90 forward packs a GQA group's query heads into its tiles' rows under a causal or local
    # mask, whatever the fill heuristic says: a tile then spans block_m / G query positions, and its
    # diagonal key blocks hold less masked work (d64 s1k causal GQA 4, 192-row tiles: 0.67 -> 0.82
    # of the MMA work useful by the tile model; FA4 packs every GQA call). Its A/B:
    # benchmarks/results/20261207-nvidia-h100-split-wait-packgqa-ab.
    sm90_pack_gqa_masked: bool = True
    # The causal sm90 backward's CTAs (one per key block) visit fewer query blocks the later their
    # keys: in launch order the longest ones of the last heads start last and the grid ends on a
    # tail. They run longest first (key blocks slowest) within chunks of (batch, KV head) pairs of
    # at least this many waves of CTAs (the heads of a chunk still meet in the L2); 0: launch order
    # (1 to 3 measured: benchmarks/results/20261204-nvidia-h200-sm90-bwd-causal-order).
    bwd_causal_chunk_waves: float = 1.5
    # Deterministic sm90 backward: a key block adds its dQ to a query block after the block before
    # it, so in launch order each head's resident key blocks form one chain of waits. The grid runs
    # in chunks of (batch, KV head) pairs, pairs fastest: as many pairs a chunk as this share of the
    # L2 holds of one pair's Q, dO and fp32 dQ; 0: launch order (larger shares lose under a causal
    # mask: benchmarks/results/20261206-nvidia-h100-sm90-bwd-det-chunks).
    bwd_det_chunk_l2_share: float = 0.25

    def __post_init__(self) -> None:
        # Hashed once: plan_fwd's memo hashes its arguments on every call.
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash

    def cluster_max_split_blocks(self, head_dim: int) -> int:
        return dict(self.decode_cluster_max_split_blocks)[head_dim]


DEFAULT = Tuning()
_current: contextvars.ContextVar[Tuning] = contextvars.ContextVar("flashgen_tuning", default=DEFAULT)


def current() -> Tuning:
    """The tuning the runtime's calls plan with (DEFAULT unless inside ``use``)."""
    return _current.get()


@contextlib.contextmanager
def use(tuning: Tuning | None = None, **changes) -> Iterator[Tuning]:
    """Run the calls inside the block with ``tuning`` (default: the current one) changed by
    ``changes`` (Tuning's field names); yields the tuning in force."""
    base = current() if tuning is None else tuning
    # (replace builds and hashes a new value: about 40 µs, on every backward that restores its forward's)
    chosen = dataclasses.replace(base, **changes) if changes else base
    token = _current.set(chosen)
    try:
        yield chosen
    finally:
        _current.reset(token)
