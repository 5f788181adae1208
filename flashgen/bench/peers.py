"""The implementations the suites time: flashgen and its peers, each a factory of calls.

A factory takes a suite's inputs and returns a call without arguments whose result is the attention
output in flash_attn's layout (batch, seqlen, nheads, d), or raises :class:`Skip` with the reason
when the implementation does not apply (a paged cache for SDPA, ...).  Transposes to other layouts
are views made outside the call.  A peer that is not installed is left out with its import error
as the reason, and one that fails its first call is reported as skipped: a number is never faked.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

from .settings import FLASHGEN

# FlashInfer plans into a workspace of its own; 128 MiB is what its examples allocate.
FLASHINFER_WORKSPACE_BYTES = 128 << 20


class Skip(Exception):
    """The implementation does not apply to this config; the message says why."""


@dataclasses.dataclass
class PrefillInputs:
    q: torch.Tensor  # (batch, seqlen, nheads, d)
    k: torch.Tensor  # (batch, seqlen, nheads_k, d)
    v: torch.Tensor
    causal: bool


@dataclasses.dataclass
class DecodeInputs:
    q: torch.Tensor              # (batch, seqlen_q, nheads, d)
    k_cache: torch.Tensor        # (batch, context, nheads_k, d), or paged (num_pages, page_size, nheads_k, d)
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor  # (batch,) int32: every sequence holds `context` keys
    block_table: torch.Tensor | None  # (batch, pages per sequence) int32 when paged
    causal: bool                 # bottom-right aligned, as in flash_attn

    @property
    def context(self) -> int:
        return int(self.cache_seqlens[0])


Factory = Callable[..., Callable[[], object]]


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    prefill: Factory | None = None
    decode: Factory | None = None
    # Entered around the factory, the first call, the check and the timing (SDPA's backend choice).
    context: Callable[[], ContextManager] = contextlib.nullcontext


def describe(exc: BaseException) -> str:
    """One line for a skip reason: the exception's type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def bhsd(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(batch, heads, seqlen, d) views, the layout SDPA and FlexAttention take."""
    return tuple(t.transpose(1, 2) for t in tensors)


def gqa_kwargs(q: torch.Tensor, k: torch.Tensor) -> dict:
    # Only passed when needed, so an MHA config does not depend on a torch that knows enable_gqa.
    return {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}


def flashgen_impl() -> Impl:
    import flashgen

    def prefill(x: PrefillInputs):
        return lambda: flashgen.flash_attn_func(x.q, x.k, x.v, causal=x.causal)

    def decode(x: DecodeInputs):
        return lambda: flashgen.flash_attn_with_kvcache(
            x.q, x.k_cache, x.v_cache, cache_seqlens=x.cache_seqlens, block_table=x.block_table,
            causal=x.causal, num_splits=0,
        )

    return Impl(FLASHGEN, prefill, decode)


def sdpa_impl(name: str, backend_name: str) -> Impl:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def prefill(x: PrefillInputs):
        q, k, v = bhsd(x.q, x.k, x.v)
        gqa = gqa_kwargs(x.q, x.k)
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=x.causal, **gqa).transpose(1, 2)

    def decode(x: DecodeInputs):
        if x.block_table is not None:
            raise Skip("SDPA takes no paged KV cache")
        # The cache in SDPA's own (batch, heads, seqlen, d) layout, as an SDPA-based server keeps it.
        q = x.q.transpose(1, 2)
        k, v = (c.transpose(1, 2).contiguous() for c in (x.k_cache, x.v_cache))
        mask = None
        if x.causal:  # is_causal would align the diagonal top-left; flash_attn aligns it bottom-right
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(q.shape[2], k.shape[2])
        groups = q.shape[1] // k.shape[1]

        def call():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa_kwargs(x.q, x.k_cache)).transpose(1, 2)

        if groups == 1:
            return call
        try:
            call()
            return call
        except RuntimeError as exc:  # this backend takes no enable_gqa: give it the heads it wants
            k_all, v_all = (t.repeat_interleave(groups, 1) for t in (k, v))

            def repeated():
                return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask).transpose(1, 2)

            repeated.note = (f"K/V heads repeated {groups}x before the call, so it reads {groups}x the bytes "
                             f"(enable_gqa refused: {describe(exc)})")
            return repeated

    return Impl(name, prefill, decode, context=lambda: sdpa_kernel(backend))


def flex_impl(dynamic: bool) -> Impl:
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # Each head dim, mask and mode is its own graph; keep them all compiled rather than let dynamo
    # fall back to the eager (math) path after its default handful of recompiles.
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 256))
    compiled = torch.compile(flex_attention, dynamic=dynamic)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx  # seqlen_q == seqlen_k here, so top-left and bottom-right agree

    def prefill(x: PrefillInputs):
        q, k, v = bhsd(x.q, x.k, x.v)
        seqlen = q.shape[2]
        mask = create_block_mask(causal, None, None, seqlen, seqlen, device=q.device) if x.causal else None
        gqa = gqa_kwargs(x.q, x.k)
        return lambda: compiled(q, k, v, block_mask=mask, **gqa).transpose(1, 2)

    return Impl("flex", prefill=prefill)


def flash_attn_impl() -> Impl:
    import flash_attn

    def prefill(x: PrefillInputs):
        return lambda: flash_attn.flash_attn_func(x.q, x.k, x.v, causal=x.causal)

    def decode(x: DecodeInputs):
        return lambda: flash_attn.flash_attn_with_kvcache(
            x.q, x.k_cache, x.v_cache, cache_seqlens=x.cache_seqlens, block_table=x.block_table,
            causal=x.causal, num_splits=0,
        )

    return Impl("flash-attn", prefill, decode)


def fa4_impl() -> Impl:
    """FlashAttention-4 (``flash_attn.cute``, CuTe DSL; its sm90 kernels on Hopper). Each
    configuration compiles on its first call (a few seconds), which the suites' warm-up absorbs."""
    from flash_attn.cute import flash_attn_func as fa4_func

    def prefill(x: PrefillInputs):
        return lambda: fa4_func(x.q, x.k, x.v, causal=x.causal)[0]

    return Impl("fa4", prefill=prefill)


def flashinfer_impl() -> Impl:
    import flashinfer

    workspaces: dict[torch.device, torch.Tensor] = {}  # one per device: calls on a stream run in turn

    def prefill(x: PrefillInputs):
        if x.q.shape[0] != 1:
            raise Skip("FlashInfer is called through its single-request prefill, which takes batch 1")
        return lambda: flashinfer.single_prefill_with_kv_cache(
            x.q[0], x.k[0], x.v[0], causal=x.causal, kv_layout="NHD"
        ).unsqueeze(0)

    def decode(x: DecodeInputs):
        batch, seqlen_q, nheads, head_dim = x.q.shape
        if seqlen_q != 1:
            raise Skip("FlashInfer's decode wrapper takes one query token")
        # A contiguous cache is a paged one with one page of `capacity` keys per sequence.
        page_size = x.k_cache.shape[1]
        table = x.block_table if x.block_table is not None else torch.arange(
            batch, dtype=torch.int32, device=x.q.device
        ).view(batch, 1)
        pages = math.ceil(x.context / page_size)
        if x.q.device not in workspaces:
            workspaces[x.q.device] = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=x.q.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspaces[x.q.device], "NHD")
        wrapper.plan(
            torch.arange(batch + 1, dtype=torch.int32, device=x.q.device) * pages,
            table[:, :pages].flatten(),
            torch.full((batch,), x.context - (pages - 1) * page_size, dtype=torch.int32, device=x.q.device),
            nheads, x.k_cache.shape[2], head_dim, page_size,
            q_data_type=x.q.dtype, kv_data_type=x.k_cache.dtype,
        )
        q = x.q[:, 0]
        return lambda: wrapper.run(q, (x.k_cache, x.v_cache)).unsqueeze(1)

    return Impl("flashinfer", decode=decode, prefill=prefill)


def load(names, flex_dynamic: bool = True) -> tuple[list[Impl], dict[str, str]]:
    """flashgen and the peers named (settings.PEERS order), and why each missing one is missing."""
    factories = {
        "sdpa-flash": lambda: sdpa_impl("sdpa-flash", "FLASH_ATTENTION"),
        "sdpa-cudnn": lambda: sdpa_impl("sdpa-cudnn", "CUDNN_ATTENTION"),
        "sdpa-efficient": lambda: sdpa_impl("sdpa-efficient", "EFFICIENT_ATTENTION"),
        "flex": lambda: flex_impl(flex_dynamic),
        "flash-attn": flash_attn_impl,
        "fa4": fa4_impl,
        "flashinfer": flashinfer_impl,
    }
    impls, missing = [flashgen_impl()], {}
    for name in names:
        try:
            impls.append(factories[name]())
        except Exception as exc:  # not installed, or a torch too old for it: left out, with the reason
            missing[name] = describe(exc)
    return impls, missing
