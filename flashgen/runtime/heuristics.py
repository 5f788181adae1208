"""Host heuristics: plain functions of the problem shape, unit-tested on the CPU."""
from __future__ import annotations

import math


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def should_pack_gqa(varlen_q: bool, seqlen_q: int, qhead_per_khead: int, block_m: int) -> bool:
    """Pack the query heads of a KV head into the M tile when that fills tiles much better.

    Always for variable-length queries (their per-sequence lengths are unknown on the host);
    otherwise pack when the unpacked tile efficiency is below 0.9x the packed one.
    """
    if varlen_q:
        return True
    nopack_efficiency = seqlen_q / _round_up(seqlen_q, block_m)
    packed_rows = seqlen_q * qhead_per_khead
    pack_efficiency = packed_rows / _round_up(packed_rows, block_m)
    return nopack_efficiency < 0.9 * pack_efficiency


def get_pack_gqa(
    arch: int,
    nheads: int,
    nheads_k: int,
    seqlen_q: int,
    block_m: int,
    varlen_q: bool = False,
    paged_kv_without_tma: bool = False,
    num_splits: int = 1,
) -> bool:
    """The PackGQA decision when the caller leaves ``pack_gqa=None``.

    Forced on for arch < 90 (the sm80 family's GQA path is the packed one there, as in
    FlashAttention-3), for paged KV without TMA and for split-KV; off for MHA; otherwise
    ``should_pack_gqa``. ``arch`` is the compute capability as 80, 86, 90, ...
    """
    if nheads == nheads_k:
        return False
    if arch < 90 or paged_kv_without_tma or num_splits > 1:
        return True
    return should_pack_gqa(varlen_q, seqlen_q, nheads // nheads_k, block_m)


def num_splits_heuristic(
    total_mblocks: int,
    num_sms: int,
    num_n_blocks: int,
    num_m_blocks: int,
    size_one_kv_head: int,
    is_causal_or_local: bool,
    max_splits: int,
    l2_bytes: int = 50 * 1024 * 1024,
) -> int:
    """How many splits of the key range fill the GPU (split-KV).

    ``total_mblocks``: CTAs without splitting; ``num_sms``: CTAs the GPU runs at once (SMs times
    CTAs per SM); ``size_one_kv_head``: bytes of K+V of one head; ``l2_bytes``: the device's L2
    size (the runtime reads it from the device). ``is_causal_or_local`` is accepted for the
    reference signature; the formula does not use it.

    1. Enough CTAs already (>= 80% of a wave): no split, unless one head's K/V overflows L2 and
       there are many query blocks, then split so each piece fits in L2.
    2. Few key blocks (<= 4): no split.
    3. Else the smallest split count whose wave efficiency (n_waves / ceil(n_waves)) is within
       85% of the best one up to min(max_splits, num_sms, num_n_blocks).
    """
    del is_causal_or_local
    if total_mblocks >= 0.8 * num_sms:
        if size_one_kv_head > l2_bytes and num_m_blocks >= num_sms * 2:
            return min(-(-size_one_kv_head // l2_bytes), max_splits)
        return 1
    if num_n_blocks <= 4:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    efficiencies = []
    for splits in range(1, max_splits + 1):
        n_waves = total_mblocks * splits / num_sms
        efficiencies.append(n_waves / math.ceil(n_waves))
    best = max(efficiencies, default=0.0)
    for splits, efficiency in enumerate(efficiencies, start=1):
        if efficiency >= 0.85 * best:
            return splits
    return 1
