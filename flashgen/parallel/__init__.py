"""Context parallelism: ring attention over a torch.distributed process group with flashgen's kernels.

q/k/v are sharded along the sequence over the ranks (``shard`` / ``shard_varlen``; zigzag by
default, which balances a causal mask).  K/V shards travel around the ring by batched
isend/irecv, each step's transfer overlapping that step's local flashgen call; partial results
are merged by their lse in fp32.  The backward sends dK/dV (fp32) around the ring with the K/V
and accumulates dQ locally.

  ring_flash_attn_func / ring_flash_attn_varlen_func   one rank of an NCCL job (under torchrun)
  simulate_ring_attention   all ranks in one process (communication by list rotation), on
                            full-sequence inputs: the same sharding, merge and backward code
  TorchLocalAttention       the local attention in PyTorch ops, for CPU runs of the above

torch.compile: the ring runs under torch.compiler.disable, so a compiled model graph-breaks
around it (fullgraph=True fails) and the ring itself runs eagerly.

PyTorch's context_parallel (torch.distributed.tensor.experimental, torch 2.13) and a custom local
kernel: its ring loops ``_templated_ring_attention`` / ``_templated_ring_attention_backward`` take
the local attention as an argument, but the public ``context_parallel()`` context never lets one
choose it: it patches F.scaled_dot_product_attention to run on DTensors, and the DTensor handler
(``_sdpa_handler``) maps the three aten SDPA overloads (flash, efficient, cuDNN) to ring wrappers
through a dict built inside the handler, each wrapper hard-coding its aten kernel.  A flashgen
call never reaches that path (it is not SDPA), and swapping the kernel means overwriting private
module state (``custom_ops``) that changes between releases.  flashgen.parallel.torch_cp offers
what the private loop accepts: flashgen forward/backward callables in its contract, for callers
that drive ``_templated_ring_attention`` themselves, at their own risk.
"""
from .local import FlashgenLocalAttention, LocalAttention, TorchLocalAttention, VarlenArgs
from .ring import merge_partial, ring_flash_attn_func, ring_flash_attn_varlen_func, simulate_ring_attention
from .sharding import (shard, shard_cu_seqlens, shard_positions, shard_varlen, step_block, unshard, unshard_varlen,
                       varlen_shard_rows)

__all__ = [
    "ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "simulate_ring_attention",
    "merge_partial",
    "LocalAttention",
    "FlashgenLocalAttention",
    "TorchLocalAttention",
    "VarlenArgs",
    "shard",
    "unshard",
    "shard_varlen",
    "unshard_varlen",
    "shard_cu_seqlens",
    "shard_positions",
    "varlen_shard_rows",
    "step_block",
]
