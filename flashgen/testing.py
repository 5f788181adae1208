"""Reference attention and accuracy checks, shared by the GPU tests, the CLI demo and the benchmarks.

Plain PyTorch, importable and usable without a GPU.

Semantics are flash_attn 2.x's (>= 2.1): masks are aligned to the bottom-right corner, so query
row ``i`` sits on the "diagonal" key position ``i + seqlen_k - seqlen_q``.

Accuracy rule (FlashAttention's): an output is correct when its max error against an upcast
reference is at most ``k`` times the max error of the same computation done by PyTorch in the input
dtype (``attention_ref(..., upcast=False)``), plus a small ``eps``.
"""
from __future__ import annotations

import math

import torch

__all__ = [
    "attention_ref",
    "generate_alibi_slopes",
    "assert_close_fa_rule",
    "assert_lse_close",
    "attention_flops",
    "philox4x32",
    "philox4x32_10",
    "DROPOUT_PHILOX_ROUNDS",
    "dropout_keep_mask",
]


def _check_args(q, k, v, window_size, softcap, alibi_slopes) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (batch, seqlen, nheads, head_dim); got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    batch, _, nheads, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            f"k and v must both be (batch={batch}, seqlen_k, nheads_k, head_dim={head_dim}); "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    nheads_k = k.shape[2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")
    if len(window_size) != 2 or any(w < -1 for w in window_size):
        raise ValueError(f"window_size must be (left, right) with each >= -1 (-1 = infinite); got {window_size!r}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 = off); got {softcap!r}")
    if alibi_slopes is not None and tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(
            f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}); got {tuple(alibi_slopes.shape)}"
        )


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    upcast: bool = True,
    reorder_ops: bool = False,
    dtype: torch.dtype | None = None,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward by PyTorch ops, with flash_attn_func's arguments and semantics.

    q: (batch, seqlen_q, nheads, d); k, v: (batch, seqlen_k, nheads_k, d), nheads % nheads_k == 0
    (query head h reads key/value head h // (nheads // nheads_k)).

    Query row i sees key j iff ``i + sk - sq - left <= j <= i + sk - sq + right`` (a -1 bound is
    infinite); ``causal=True`` is the window ``(left, 0)``.  Scores are ``softmax_scale * q.k``
    (default ``1/sqrt(d)``), then ``softcap * tanh(scores / softcap)`` if softcap > 0, then
    ``- slope * |i + sk - sq - j|`` if ALiBi slopes ((nheads,) or (batch, nheads), fp32) are given.
    A row that sees no key (or seqlen_k == 0) has output 0 and lse -inf.

    upcast=True: everything in ``dtype``, by default float64 for CPU inputs and float32 for GPU
    inputs (FlashAttention's reference; TF32 must be off, PyTorch's default).  Returns out in that
    dtype and lse (batch, nheads, seqlen_q) in that dtype, so errors against it are measured exactly.

    upcast=False: the same computation as PyTorch code in the input dtype would do it: matmuls and
    softmax on low-precision scores, probabilities cast to v.dtype before the second matmul; out is
    in the input dtype.  An fp32 ALiBi bias promotes the scores to float32 as PyTorch's type
    promotion does (as in flash_attn's reference).  lse is returned as float32.

    reorder_ops=True scales k instead of q: the same math rounded differently, to estimate the error
    due to operation order alone.

    dropout_mask (batch, nheads, seqlen_q, seqlen_k) bool: probabilities where it is False are
    dropped and the kept ones scaled as the kernels scale them (256 / threshold, see
    flashgen.runtime.dropout.dropout_threshold_and_scale; after the lse, which dropout leaves alone).
    """
    _check_args(q, k, v, window_size, softcap, alibi_slopes)
    if upcast:
        compute_dtype = dtype or (torch.float64 if q.device.type == "cpu" else torch.float32)
    elif dtype is not None:
        raise ValueError(f"dtype={dtype} only applies with upcast=True; upcast=False computes in q.dtype")
    else:
        compute_dtype = q.dtype
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    q, k, v = (x.to(compute_dtype) for x in (q, k, v))
    k = k.repeat_interleave(nheads // nheads_k, dim=2)
    v = v.repeat_interleave(nheads // nheads_k, dim=2)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    if reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)

    # rel[i, j] = j - (i + sk - sq): key position relative to row i's bottom-right-aligned diagonal.
    device = q.device
    rel = torch.arange(seqlen_k, device=device)[None, :] - torch.arange(seqlen_q, device=device)[:, None]
    rel = rel - (seqlen_k - seqlen_q)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=device, dtype=torch.promote_types(compute_dtype, torch.float32))
        slopes = slopes.reshape(-1, nheads, 1, 1)  # (nheads,) broadcasts over batch
        scores = scores - slopes * rel.abs()
    left, right = window_size
    if causal:
        right = 0
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= rel <= right
    if left >= 0:
        visible &= rel >= -left
    scores = scores.masked_fill(~visible, float("-inf"))

    lse = torch.logsumexp(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    # softmax of an all -inf row is NaN; FlashAttention defines that row's output as 0.
    probs = torch.softmax(scores, dim=-1).masked_fill(~visible.any(dim=-1, keepdim=True), 0.0)
    if dropout_mask is not None:
        from .runtime.dropout import dropout_threshold_and_scale

        probs = probs.masked_fill(~dropout_mask, 0.0) * dropout_threshold_and_scale(dropout_p)[1]
    out = torch.einsum("bhts,bshd->bthd", probs.to(v.dtype), v)
    return out, lse


def generate_alibi_slopes(nheads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The ALiBi paper's geometric slopes, fp32 (nheads,): 2^(-8/n), 2^(-16/n), ... for a power
    of two n; otherwise those of the largest power of two below nheads, then every other slope of
    twice that power."""
    if nheads < 1:
        raise ValueError(f"nheads must be >= 1; got {nheads}")

    def power_of_two_slopes(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    closest = 2 ** int(math.floor(math.log2(nheads)))
    slopes = power_of_two_slopes(closest) + power_of_two_slopes(2 * closest)[0::2][: nheads - closest]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def _where(t: torch.Tensor, flat_index: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(flat_index, t.shape))


def assert_close_fa_rule(
    out: torch.Tensor,
    out_ref: torch.Tensor,
    out_pt: torch.Tensor,
    k: float = 2.0,
    eps: float = 1e-5,
    name: str = "out",
) -> None:
    """FlashAttention's rule: ``out`` is finite and max|out - out_ref| <= k * max|out_pt - out_ref| + eps.

    out_ref: upcast reference; out_pt: the same computation in the input dtype
    (``attention_ref(..., upcast=False)``).  Raises AssertionError naming the worst element.
    """
    if out.shape != out_ref.shape or out_pt.shape != out_ref.shape:
        raise AssertionError(
            f"{name}: shape {tuple(out.shape)}, reference {tuple(out_ref.shape)}, "
            f"PyTorch {tuple(out_pt.shape)} differ"
        )
    nonfinite = ~torch.isfinite(out)
    if nonfinite.any():
        first = _where(out, nonfinite.flatten().nonzero()[0, 0])
        raise AssertionError(
            f"{name}: {int(nonfinite.sum())} of {out.numel()} values are NaN/inf; first at index "
            f"{first}: {out[first].item()}"
        )
    if out.numel() == 0:
        return
    err = (out.to(out_ref.dtype) - out_ref).abs()
    pt_err = (out_pt.to(out_ref.dtype) - out_ref).abs().max().item()
    max_err = err.max().item()
    bound = k * pt_err + eps
    if not max_err <= bound:
        worst = _where(err, err.argmax())
        raise AssertionError(
            f"{name}: max |{name} - ref| = {max_err:.3e} at index {worst} ({name} {out[worst].item():.6g}, "
            f"ref {out_ref[worst].item():.6g}) exceeds {k} * {pt_err:.3e} (PyTorch in {out_pt.dtype}) "
            f"+ {eps:.0e} = {bound:.3e}; {int((err > bound).sum())} of {err.numel()} elements over"
        )


def assert_lse_close(
    lse: torch.Tensor,
    lse_ref: torch.Tensor,
    atol: float = 1e-3,
    rtol: float = 1e-3,
    name: str = "lse",
) -> None:
    """-inf (rows that see no key) exactly where the reference has it, no NaN/+inf, and the finite
    entries within ``atol + rtol * |lse_ref|``."""
    if lse.shape != lse_ref.shape:
        raise AssertionError(f"{name}: shape {tuple(lse.shape)} != reference {tuple(lse_ref.shape)}")
    invalid = torch.isnan(lse) | torch.isposinf(lse)
    if invalid.any():
        first = _where(lse, invalid.flatten().nonzero()[0, 0])
        raise AssertionError(f"{name}: {int(invalid.sum())} NaN/+inf values; first at index {first}: {lse[first].item()}")
    pattern_differs = torch.isneginf(lse) != torch.isneginf(lse_ref)
    if pattern_differs.any():
        first = _where(lse, pattern_differs.flatten().nonzero()[0, 0])
        raise AssertionError(
            f"{name}: -inf pattern differs from the reference at {int(pattern_differs.sum())} positions; "
            f"first at index {first}: {name} {lse[first].item()}, ref {lse_ref[first].item()}"
        )
    finite = torch.isfinite(lse_ref)
    if not finite.any():
        return
    ref = lse_ref.to(torch.float64)
    err = torch.where(finite, (lse.to(torch.float64) - ref).abs(), 0.0)
    excess = err - (atol + rtol * torch.where(finite, ref.abs(), 0.0))
    if excess.max().item() > 0:
        worst = _where(excess, excess.argmax())
        raise AssertionError(
            f"{name}: |{name} - ref| = {err[worst].item():.3e} at index {worst} ({name} {lse[worst].item():.6g}, "
            f"ref {lse_ref[worst].item():.6g}) exceeds {atol:.0e} + {rtol:.0e} * |ref|; "
            f"{int((excess > 0).sum())} of {int(finite.sum())} finite entries over"
        )


_MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def attention_flops(
    batch: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    causal: bool,
    mode: str = "fwd",
) -> float:
    """FLOPs of attention by FlashAttention's benchmark convention, so TFLOP/s compare with its
    published numbers: 4 * b * h * sq * sk * d for the forward (two matmuls), halved when causal
    (even when sq != sk, where the exact count of visible pairs differs), times 2.5 for "bwd" and
    3.5 for "fwd_bwd"."""
    if mode not in _MODE_FACTOR:
        raise ValueError(f"mode must be one of {tuple(_MODE_FACTOR)}; got {mode!r}")
    flops = 4 * batch * nheads * seqlen_q * seqlen_k * head_dim / (2 if causal else 1)
    return flops * _MODE_FACTOR[mode]


# --- dropout -------------------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF
_DROPOUT_DOMAIN = 0x666C6773  # kDropoutDomain in templates/common.cuh
_PHILOX_W0 = 0x9E3779B9  # mixes the offset's high word into the key, as Dropout::from does


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b for a uint32 constant and uint32 values held in int64
    (split in 16-bit halves so no product overflows int64)."""
    low = a * (b & 0xFFFF)
    high = a * (b >> 16)
    t = low + ((high & 0xFFFF) << 16)
    return (high >> 16) + (t >> 32), t & _MASK32


# Rounds of the dropout mask's Philox: kPhiloxRounds in templates/common.cuh (why seven: there).
DROPOUT_PHILOX_ROUNDS = 7


def philox4x32(counter, key, rounds: int):
    """Philox4x32 with ``rounds`` rounds (Random123) on tensors: counter a 4-tuple and key a 2-tuple
    of int64 tensors (or ints) holding uint32 values; returns the 4 output words as int64 tensors."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in counter)
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64) for k in key)
    for _ in range(rounds):
        hi0, lo0 = _mulhilo32(0xD2511F53, c0)
        hi1, lo1 = _mulhilo32(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + 0x9E3779B9) & _MASK32
        k1 = (k1 + 0xBB67AE85) & _MASK32
    return c0, c1, c2, c3


def philox4x32_10(counter, key):
    """Philox4x32-10, Random123's default round count (philox4x32 with rounds=10)."""
    return philox4x32(counter, key, 10)


def dropout_keep_mask(rng_state: torch.Tensor, dropout_p: float, batch: int, nheads: int, seqlen_q: int,
                      seqlen_k: int, device=None) -> torch.Tensor:
    """The dropout pattern of a flashgen call, (batch, nheads, seqlen_q, seqlen_k) bool (True: kept),
    recomputed from its rng_state ([seed, offset], int64) as the kernels compute it (Dropout in
    templates/common.cuh). Query and key positions are those within each sequence."""
    from .runtime.dropout import dropout_threshold_and_scale

    seed, offset = (int(x) for x in rng_state.tolist())
    threshold = dropout_threshold_and_scale(float(dropout_p))[0]
    device = device if device is not None else "cpu"
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(nheads, device=device).view(1, -1, 1, 1)
    i = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1)
    # One Philox block per (query, 64-key group g, quad lane q): counter word 0 is 4 g + q.
    block = torch.arange(4 * -(-seqlen_k // 64), device=device).view(1, 1, 1, -1)
    words = philox4x32(
        (block, i, (b * nheads + h) & _MASK32, offset & _MASK32),
        ((seed & _MASK32) ^ (((offset >> 32) * _PHILOX_W0) & _MASK32), ((seed >> 32) & _MASK32) ^ _DROPOUT_DOMAIN),
        DROPOUT_PHILOX_ROUNDS,
    )
    shape = torch.broadcast_shapes(b.shape, h.shape, i.shape, block.shape)
    words = torch.stack([w.expand(shape) for w in words], dim=-1)           # (..., 4 g + q, word c)
    shifts = torch.arange(4, device=device) * 8
    random_bytes = (words.unsqueeze(-1) >> shifts) & 0xFF                  # (..., 4 g + q, c, byte 2 n + e)
    # key j = 64 g + 16 c + 8 n + 2 q + e: order the axes (g, c, n, q, e) and flatten.
    random_bytes = random_bytes.unflatten(-3, (-1, 4)).unflatten(-1, (2, 2))  # (..., g, q, c, n, e)
    random_bytes = random_bytes.permute(*range(random_bytes.dim() - 5), -5, -3, -2, -4, -1)
    random_bytes = random_bytes.flatten(-5)[..., :seqlen_k]
    return random_bytes < threshold
