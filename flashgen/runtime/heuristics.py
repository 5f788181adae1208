"""Host heuristics: plain functions of the problem shape, unit-tested on the CPU."""
from __future__ import annotations


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
