"""What ``flashgen bench`` runs: the suites, their axes, and the full and ``--quick`` defaults.

Plain Python without torch, so that the CLI builds its options and help from it cheaply and the
config lists can be tested on a CPU.  The full defaults are sized to run in about four minutes on
an H200, first-use compiles included; options widen any axis.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

SUITES = ("prefill", "decode", "compile")
FLASHGEN = "flashgen"
MODES = ("fwd", "bwd", "fwd_bwd")  # bwd: the backward alone, after one untimed forward
DTYPES = ("bf16", "fp16")
MASKS = ("none", "causal")
# Every implementation besides flashgen, in table order.  flash-attn, FlashAttention-4 (fa4:
# flash_attn.cute) and FlashInfer join when importable.
PEERS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex", "flash-attn", "fa4", "flashinfer")

# Decode calls are also replayed from a CUDA graph; below this the graph's figure is the headline,
# since an eager call that short measures the host's launch path, not the kernel.
GRAPH_BELOW_US = 400.0

# FlashAttention's published methodology: batch x seqlen = 16k tokens, hidden = nheads x d = 2048.
TOKENS, HIDDEN = 16384, 2048

FULL = {
    "modes": MODES,
    "dtypes": ("bf16",),
    "head_dims": (64, 128, 256),
    "seqlens": (1024, 4096, 16384),
    "masks": MASKS,
    "gqa": (1,),
    "query_lens": (1,),
    "contexts": (2048, 8192, 32768, 131072),
    "batches": (1, 16, 128),
    "layouts": ("contiguous", "paged16", "paged256"),
    "heads": ((32, 8),),
    "decode_head_dims": (128,),
    "cold_count": 8,
    "matrix_filter": None,  # the whole matrix for this GPU's target
}
QUICK = {
    **FULL,
    "head_dims": (128,),
    "seqlens": (4096,),
    "contexts": (8192, 131072),
    "batches": (1, 16),
    "layouts": ("contiguous", "paged256"),
    "cold_count": 4,
    "matrix_filter": "hdim128_bf16",
}


@dataclasses.dataclass(frozen=True)
class Settings:
    suites: tuple[str, ...] = SUITES
    peers: tuple[str, ...] = PEERS
    dtypes: tuple[str, ...] = FULL["dtypes"]
    # prefill
    modes: tuple[str, ...] = FULL["modes"]
    head_dims: tuple[int, ...] = FULL["head_dims"]
    seqlens: tuple[int, ...] = FULL["seqlens"]
    masks: tuple[str, ...] = FULL["masks"]
    gqa: tuple[int, ...] = FULL["gqa"]          # query heads per KV head; 1 is MHA
    tokens: int = TOKENS
    hidden: int = HIDDEN
    flex_dynamic: bool = True                    # one FlexAttention compile serves every seqlen
    # decode
    query_lens: tuple[int, ...] = FULL["query_lens"]
    contexts: tuple[int, ...] = FULL["contexts"]
    batches: tuple[int, ...] = FULL["batches"]
    layouts: tuple[str, ...] = FULL["layouts"]
    heads: tuple[tuple[int, int], ...] = FULL["heads"]
    decode_head_dims: tuple[int, ...] = FULL["decode_head_dims"]
    max_kv_gib: float = 32.0
    # compile
    jobs: int = 1
    cold_count: int = FULL["cold_count"]
    warm_runs: int = 3
    matrix_filter: str | None = FULL["matrix_filter"]


def resolve(quick: bool = False, **given) -> Settings:
    """Settings from the full (or quick) defaults, with every option the user gave (not None) on top."""
    base = QUICK if quick else FULL
    values = {name: base[name] for name in base}
    values.update({name: value for name, value in given.items() if value is not None})
    return Settings(**values)


def parse_layout(text: str) -> int | None:
    """"contiguous" or "hnd" -> None, "pagedN" -> page size N. "contiguous" is flash_attn's cache,
    (batch, seqlen, heads, d); "hnd" holds the same view over memory laid out (batch, heads, seqlen,
    d), SDPA's layout, in which each head's keys are one contiguous run."""
    if text in ("contiguous", "hnd"):
        return None
    if text.startswith("paged") and text[5:].isdigit() and int(text[5:]) >= 1:
        return int(text[5:])
    raise ValueError(f"{text!r} is not a layout: use contiguous, hnd or pagedN (N >= 1 keys per page, e.g. paged16)")


def parse_heads(text: str) -> tuple[int, int]:
    """"32/8" -> (32 query heads, 8 KV heads)."""
    try:
        nheads, nheads_k = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"{text!r} is not QUERY/KV heads (e.g. 32/8)") from None
    if nheads_k < 1 or nheads < nheads_k or nheads % nheads_k:
        raise ValueError(f"{text!r}: query heads must be a positive multiple of the KV heads")
    return nheads, nheads_k


def prefill_configs(s: Settings) -> tuple[list[dict], list[str]]:
    """The prefill configs (FlashAttention's shapes) and a note for each axis combination dropped."""
    configs, notes = [], []
    for mode, dtype, head_dim, seqlen, mask, gqa in itertools.product(
        s.modes, s.dtypes, s.head_dims, s.seqlens, s.masks, s.gqa
    ):
        nheads = s.hidden // head_dim
        if nheads < 1 or nheads % gqa:
            notes.append(f"prefill d{head_dim} gqa {gqa}: hidden {s.hidden} gives {nheads} heads, "
                         f"not a multiple of {gqa}")
            continue
        configs.append({
            "mode": mode, "dtype": dtype, "head_dim": head_dim, "seqlen": seqlen,
            "batch": max(1, s.tokens // seqlen), "nheads": nheads, "nheads_k": nheads // gqa,
            "causal": mask == "causal",
        })
    return configs, list(dict.fromkeys(notes))


def decode_configs(s: Settings) -> list[dict]:
    return [
        {
            "dtype": dtype, "batch": batch, "seqlen_q": seqlen_q, "context": context,
            "nheads": nheads, "nheads_k": nheads_k, "head_dim": head_dim,
            "layout": layout, "page_size": parse_layout(layout),
            # Several new tokens are causal among themselves, as in speculative decoding.
            "causal": seqlen_q > 1,
        }
        for dtype, (nheads, nheads_k), head_dim, seqlen_q, layout, batch, context in itertools.product(
            s.dtypes, s.heads, s.decode_head_dims, s.query_lens, s.layouts, s.batches, s.contexts
        )
    ]


def kv_bytes(config: dict, element_size: int = 2) -> int:
    """K+V bytes a decode call must read: every valid key of every batch element, once."""
    c = config
    return 2 * c["batch"] * c["context"] * c["nheads_k"] * c["head_dim"] * element_size


def cache_bytes(config: dict, element_size: int = 2) -> int:
    """K+V bytes allocated for one copy: the paged layout rounds each sequence up to whole pages."""
    page = config["page_size"]
    context = config["context"] if page is None else math.ceil(config["context"] / page) * page
    return kv_bytes({**config, "context": context}, element_size)
