"""How a sequence is split over the ranks of a ring, and which key blocks each ring step needs.

Layouts (N ranks):
  contiguous  rank r holds rows [r * S/N, (r + 1) * S/N) of every sequence.
  zigzag      the sequence is cut into 2N equal chunks; rank r holds chunks r and 2N-1-r, in that
              order.  Under a causal mask every rank then has the same amount of work per step.

At ring step s, rank r holds the keys/values of the source rank (r - s) mod N.  With a causal mask
(all positions global, query position i sees key j iff j <= i):

  contiguous  source == r: the local block is causal; source < r: every key is visible;
              source > r: no key is visible (skipped).
  zigzag      source == r: causal on the local rows: chunk r precedes chunk 2N-1-r both in the
              sequence and in the shard, so the shard's own causal mask is the global one.
              source < r: queries (chunks r, 2N-1-r) see all of the source's first chunk (source < r)
              and none of its second (2N-1-source > 2N-1-r > r): all queries x the first half of
              the keys, no mask.
              source > r: chunk r sees neither source chunk (both come later), chunk 2N-1-r sees
              both (2N-1-r > 2N-1-source > source): the second half of the queries x all keys, no
              mask.
Without a causal mask every step is all queries x all keys.
"""
from __future__ import annotations

import typing

import torch

LAYOUTS = ("zigzag", "contiguous")

# Which rows of a shard a block uses: all of them, or the first / second of its two chunks.
ALL, FIRST, SECOND = "all", "first", "second"


class Block(typing.NamedTuple):
    """One local attention call of a ring step: the query part, the key part, and whether the
    causal mask applies within it (always with as many query as key rows)."""
    q_part: str
    k_part: str
    causal: bool


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")


def check_world_size(world_size) -> None:
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")


def step_block(layout: str, world_size: int, rank: int, source: int, causal: bool) -> Block | None:
    """The block rank ``rank`` computes against the keys of rank ``source``, or None if it sees
    none of them (derivation in the module docstring)."""
    if not causal:
        return Block(ALL, ALL, False)
    if source == rank:
        return Block(ALL, ALL, True)
    if layout == "contiguous":
        return Block(ALL, ALL, False) if source < rank else None
    return Block(ALL, FIRST, False) if source < rank else Block(SECOND, ALL, False)


def chunks_of_rank(layout: str, world_size: int, rank: int) -> tuple[int, ...]:
    """The sequence chunks a rank holds, in shard order: of 2N chunks (zigzag) or of N (contiguous)."""
    return (rank, 2 * world_size - 1 - rank) if layout == "zigzag" else (rank,)


def chunk_count(layout: str, world_size: int) -> int:
    return 2 * world_size if layout == "zigzag" else world_size


def shard_positions(layout: str, world_size: int, rank: int, seqlen: int) -> torch.Tensor:
    """Global positions (int64) of a rank's shard rows, for a sequence of ``seqlen`` rows."""
    check_layout(layout)
    count = chunk_count(layout, world_size)
    if seqlen % count:
        raise ValueError(
            f"seqlen ({seqlen}) must be a multiple of {count} for layout {layout!r} over {world_size} ranks")
    chunk = seqlen // count
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunks_of_rank(layout, world_size, rank)])


def shard(x: torch.Tensor, world_size: int, rank: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of ``x`` along ``dim`` (differentiable; a copy for zigzag)."""
    check_world_size(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}); got {rank}")
    positions = shard_positions(layout, world_size, rank, x.shape[dim])
    return x.index_select(dim, positions.to(x.device))


def unshard(shards: typing.Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard (rank order), the inverse of ``shard``."""
    check_layout(layout)
    world_size = len(shards)
    check_world_size(world_size)
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


# --- packed variable-length batches -----------------------------------------------------------------

def _lengths(cu_seqlens: torch.Tensor, name: str) -> list[int]:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor (batch + 1,); got {cu_seqlens!r}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32; got {cu_seqlens.dtype}")
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    if bounds[0] != 0 or any(n < 0 for n in lengths):
        raise ValueError(f"{name} must start at 0 and not decrease; got {bounds}")
    return lengths


def shard_cu_seqlens(cu_seqlens: torch.Tensor, world_size: int, layout: str = "zigzag") -> torch.Tensor:
    """Per-shard cu_seqlens: every rank holds 1/N of every sequence (the same on each rank)."""
    check_world_size(world_size)
    check_layout(layout)
    count = chunk_count(layout, world_size)
    lengths = _lengths(cu_seqlens, "cu_seqlens")
    if any(n % count for n in lengths):
        raise ValueError(
            f"cu_seqlens: every sequence length must be a multiple of {count} for layout {layout!r} over "
            f"{world_size} ranks; got lengths {lengths}")
    local = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0) // world_size
    return local.to(dtype=torch.int32, device=cu_seqlens.device)


def varlen_shard_rows(cu_seqlens: torch.Tensor, world_size: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """Global row indices (int64, on cu_seqlens' device) of rank ``rank``'s shard of a packed batch:
    its part of sequence 0, then of sequence 1, ..."""
    check_world_size(world_size)
    lengths = _lengths(cu_seqlens, "cu_seqlens")
    starts = cu_seqlens.tolist()[:-1]
    rows = [start + shard_positions(layout, world_size, rank, n) for start, n in zip(starts, lengths)]
    return torch.cat(rows).to(cu_seqlens.device) if rows else torch.zeros(0, dtype=torch.int64)


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, world_size: int, rank: int,
                 layout: str = "zigzag") -> torch.Tensor:
    """Rank ``rank``'s shard of a packed (total, ...) tensor (differentiable)."""
    return x.index_select(0, varlen_shard_rows(cu_seqlens, world_size, rank, layout).to(x.device))


def unshard_varlen(shards: typing.Sequence[torch.Tensor], cu_seqlens: torch.Tensor, layout: str = "zigzag",
                   dim: int = 0) -> torch.Tensor:
    """The packed tensor from every rank's shard along ``dim`` (0 for q/k/v/out, -1 for lse),
    the inverse of ``shard_varlen``."""
    world_size = len(shards)
    order = torch.cat([varlen_shard_rows(cu_seqlens, world_size, r, layout) for r in range(world_size)])
    stacked = torch.cat(list(shards), dim=dim)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return stacked.index_select(dim, inverse.to(stacked.device))


def half_rows(cu_seqlens_local: torch.Tensor, part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the first or second chunk of every sequence of a zigzag shard: (row indices int64,
    their cu_seqlens int32), both on cu_seqlens_local's device."""
    bounds = cu_seqlens_local.tolist()
    rows = []
    for start, end in zip(bounds, bounds[1:]):
        half = (end - start) // 2
        first = start if part == FIRST else start + half
        rows.append(torch.arange(first, first + half))
    index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    cu_half = (cu_seqlens_local.to(torch.int64) // 2).to(torch.int32)
    return index.to(cu_seqlens_local.device), cu_half
