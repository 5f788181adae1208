"""References for ``flash_attn_with_kvcache`` and the split-KV combine, for the tests and benchmarks.

Plain PyTorch on CPU or GPU, built on :func:`flashgen.testing.attention_ref`: each batch element's
valid keys are gathered from its cache row (or its pages) into a dense tensor and attended to with
the dense semantics, so the KV-cache rules (append position, rotary positions, leftpad, page
addressing) are written down once, here, separately from the masks.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .testing import attention_ref

__all__ = [
    "KVCacheRef",
    "rotary_tables",
    "apply_rotary_ref",
    "kvcache_ref",
    "combine_ref",
    "random_block_table",
    "paged_kv_from_contiguous",
]


def rotary_tables(
    seqlen_ro: int, rotary_dim: int, base: float = 10000.0, dtype=torch.float32, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's (cos, sin) tables, each (seqlen_ro, rotary_dim / 2): angle ``t * base^(-2j / rotary_dim)``
    for position t and pair j, computed in float64 and rounded once to ``dtype``."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.outer(torch.arange(seqlen_ro, dtype=torch.float64), inv_freq)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def apply_rotary_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding in float32: x (b, s, h, d), cos / sin (seqlen_ro, rotary_dim / 2), positions
    (b, s) integer rows of the tables.  Returns a new float32 tensor shaped like x.

    Pairs are (2j, 2j + 1) when ``interleaved`` (GPT-J) and (j, j + rotary_dim / 2) otherwise
    (GPT-NeoX); each becomes ``(a cos - b sin, a sin + b cos)`` with the angle of table column j.
    Dims from rotary_dim on pass through.
    """
    if cos.shape != sin.shape or cos.dim() != 2:
        raise ValueError(
            f"cos and sin must both be (seqlen_ro, rotary_dim / 2); got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    half = cos.shape[1]
    if 2 * half > x.shape[-1]:
        raise ValueError(f"rotary_dim {2 * half} exceeds head_dim {x.shape[-1]}")
    if positions.shape != x.shape[:2]:
        raise ValueError(f"positions must be (batch, seqlen) = {tuple(x.shape[:2])}; got {tuple(positions.shape)}")
    if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < cos.shape[0]:
        raise ValueError(f"positions must lie in [0, {cos.shape[0]}) (the tables' rows); got "
                         f"[{int(positions.min())}, {int(positions.max())}]")
    x = x.to(torch.float32, copy=True)
    c = cos.float()[positions.long()].unsqueeze(2)  # (b, s, 1, half): one angle per pair, shared by heads
    s = sin.float()[positions.long()].unsqueeze(2)
    rot = x[..., : 2 * half]
    a, b = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    ra, rb = a * c - b * s, a * s + b * c
    x[..., : 2 * half] = torch.stack((ra, rb), dim=-1).flatten(-2) if interleaved else torch.cat((ra, rb), dim=-1)
    return x


class KVCacheRef(NamedTuple):
    k_cache: torch.Tensor  # the cache as the call must leave it (a new tensor)
    v_cache: torch.Tensor
    out: torch.Tensor      # (batch, seqlen_q, nheads, d): attention_ref's dtype (upcast) or q.dtype
    lse: torch.Tensor      # (batch, nheads, seqlen_q)
    written: torch.Tensor  # bool over the cache's first two dims: the rows the append writes


def kvcache_ref(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
    return_softmax_lse=False, pack_gqa=None, *, upcast=True,
) -> KVCacheRef:
    """What ``flash_attn_with_kvcache`` with the same arguments must return and leave in the cache.

    The inputs are not modified.  ``num_splits``, ``return_softmax_lse`` and ``pack_gqa`` are
    accepted so that one dict of arguments serves both calls; they do not change the result.
    ``upcast`` is attention_ref's: True for the reference, False for the same computation in the
    input dtype (``out_pt`` of FlashAttention's accuracy rule).

    Rules (flash_attn 2.x):
    * batch b uses cache row ``cache_batch_idx[b]`` (default b), or, with ``block_table``, cache
      position p at page ``block_table[b, p // page_size]``, row ``p % page_size``;
    * new k (rotated when rotary tables are given, rounded to the cache dtype) and v go to positions
      ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1``; ``cache_seqlens=None`` means the
      whole cache is valid (and full);
    * keys ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)`` are attended to, with masks and
      ALiBi positions relative to the first of them (dense semantics on that range);
    * q is rotated at position ``cache_seqlens[b] + i`` for row i when causal or local, at
      ``cache_seqlens[b]`` for every row otherwise, then rounded to q.dtype as the kernel feeds it
      to the matmul.
    """
    del num_splits, return_softmax_lse, pack_gqa
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if block_table is not None and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx cannot be combined with block_table")
    batch, seqlen_q = q.shape[:2]
    seqlen_new = k.shape[1] if k is not None else 0
    device = k_cache.device
    if block_table is not None:
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size
        table = block_table.to(device=device, dtype=torch.long)
    else:
        capacity = k_cache.shape[1]
        cache_rows = cache_batch_idx.tolist() if cache_batch_idx is not None else range(batch)

    def cache_index(b: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dim-0 index, dim-1 index) into the cache of batch b's cache positions."""
        if block_table is not None:
            return table[b, positions // page_size], positions % page_size
        return torch.full_like(positions, cache_rows[b]), positions

    if cache_seqlens is None:
        seqlens = [capacity] * batch
    elif isinstance(cache_seqlens, int):
        seqlens = [cache_seqlens] * batch
    else:
        seqlens = cache_seqlens.tolist()
    leftpad = cache_leftpad.tolist() if cache_leftpad is not None else [0] * batch
    for b in range(batch):
        if not (0 <= leftpad[b] <= seqlens[b] and seqlens[b] + seqlen_new <= capacity):
            raise ValueError(f"batch {b}: need 0 <= leftpad ({leftpad[b]}) <= cache_seqlens ({seqlens[b]}) "
                             f"and cache_seqlens + seqlen_new ({seqlen_new}) <= cache capacity ({capacity})")
    seqlens_t = torch.tensor(seqlens, device=device)[:, None]

    if rotary_cos is not None:
        # Query row i sits at cache_seqlens + i when causal or local, else every row at cache_seqlens.
        per_row = causal or tuple(window_size) != (-1, -1)
        rows = torch.arange(seqlen_q, device=device) * int(per_row)
        q = apply_rotary_ref(q, rotary_cos, rotary_sin, seqlens_t + rows, rotary_interleaved).to(q.dtype)
        if k is not None:
            new_positions = seqlens_t + torch.arange(seqlen_new, device=device)[None, :]
            k = apply_rotary_ref(k, rotary_cos, rotary_sin, new_positions, rotary_interleaved)

    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=device)
    outs, lses = [], []
    for b in range(batch):
        if k is not None:
            index = cache_index(b, torch.arange(seqlens[b], seqlens[b] + seqlen_new, device=device))
            k_cache[index] = k[b].to(k_cache.dtype)
            v_cache[index] = v[b].to(v_cache.dtype)
            written[index] = True
        index = cache_index(b, torch.arange(leftpad[b], seqlens[b] + seqlen_new, device=device))
        slopes = alibi_slopes[b : b + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        out, lse = attention_ref(
            q[b : b + 1], k_cache[index][None], v_cache[index][None], causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=slopes, softmax_scale=softmax_scale, upcast=upcast,
        )
        outs.append(out)
        lses.append(lse)
    return KVCacheRef(k_cache, v_cache, torch.cat(outs), torch.cat(lses), written)


def combine_ref(out_partial: torch.Tensor, lse_partial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge split-KV partials in float64: out_partial (splits, *rows, d), lse_partial (splits, *rows).

    Returns (out (*rows, d), lse (*rows)): ``lse = logsumexp_s lse_s`` and ``out = sum_s w_s O_s``
    with ``w_s = exp(lse_s - lse)``.  A split with lse -inf saw no key: it contributes nothing,
    whatever its O holds (NaN included); a row no split saw gets out 0 and lse -inf.
    """
    lse_partial = lse_partial.to(torch.float64)
    empty = torch.isneginf(lse_partial)
    lse = torch.logsumexp(lse_partial, dim=0)
    # exp(-inf - (-inf)) is NaN for a row no split saw: the empty mask decides those weights.
    weights = torch.where(empty, 0.0, torch.exp(lse_partial - lse))
    partial = torch.where(empty[..., None], 0.0, out_partial.to(torch.float64))
    return (weights[..., None] * partial).sum(dim=0), lse


def random_block_table(
    batch: int, max_pages: int, num_blocks: int, generator: torch.Generator | None = None, device=None
) -> torch.Tensor:
    """(batch, max_pages) int32 block table of distinct random pages out of num_blocks, so that a
    kernel that reads the wrong page, or batch element b's pages for another, reads other data."""
    if num_blocks < batch * max_pages:
        raise ValueError(f"num_blocks ({num_blocks}) must be >= batch * max_pages ({batch * max_pages})")
    pages = torch.randperm(num_blocks, generator=generator)[: batch * max_pages]
    return pages.view(batch, max_pages).to(device=device, dtype=torch.int32)


def paged_kv_from_contiguous(
    cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int, page_size: int, fill: float = float("nan")
) -> torch.Tensor:
    """The paged (num_blocks, page_size, h, d) form of a contiguous (batch, seqlen, h, d) cache:
    position p of row b lands at page block_table[b, p // page_size], row p % page_size.

    Pages the table does not name, and positions past seqlen in the last pages, hold ``fill``:
    NaN by default, so a kernel that reads them produces NaN instead of a plausible number.
    """
    batch, seqlen = cache.shape[:2]
    max_pages = block_table.shape[1]
    if block_table.shape[0] != batch or seqlen > max_pages * page_size:
        raise ValueError(f"block_table {tuple(block_table.shape)} with page_size {page_size} cannot hold "
                         f"a cache of {batch} rows of {seqlen} positions")
    padded = cache.new_full((batch, max_pages * page_size, *cache.shape[2:]), fill)
    padded[:, :seqlen] = cache
    paged = cache.new_full((num_blocks, page_size, *cache.shape[2:]), fill)
    paged[block_table.long()] = padded.view(batch, max_pages, page_size, *cache.shape[2:])
    return paged
