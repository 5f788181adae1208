"""CPU tier: flashgen.testing's reference attention and accuracy helpers.

The reference is checked against a per-element loop written in plain Python floats, which shares no
code with it, on tiny float64 shapes.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from flashgen.testing import (
    assert_close_fa_rule,
    assert_lse_close,
    attention_flops,
    attention_ref,
    generate_alibi_slopes,
)


def naive_attention(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, softmax_scale=None):
    """One query row, one head at a time, straight from the definition."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    left, right = window_size
    qs, ks, vs = q.tolist(), k.tolist(), v.tolist()
    slopes = alibi_slopes.tolist() if alibi_slopes is not None else None
    out = torch.zeros(batch, seqlen_q, nheads, head_dim, dtype=torch.float64)
    lse = torch.full((batch, nheads, seqlen_q), -math.inf, dtype=torch.float64)
    for b, h, i in itertools.product(range(batch), range(nheads), range(seqlen_q)):
        kv_head = h // (nheads // nheads_k)
        diag = i + seqlen_k - seqlen_q
        scores = {}
        for j in range(seqlen_k):
            if (causal and j > diag) or (right >= 0 and j > diag + right) or (left >= 0 and j < diag - left):
                continue
            s = scale * sum(a * c for a, c in zip(qs[b][i][h], ks[b][j][kv_head]))
            if softcap > 0:
                s = softcap * math.tanh(s / softcap)
            if slopes is not None:
                slope = slopes[h] if alibi_slopes.dim() == 1 else slopes[b][h]
                s -= slope * abs(diag - j)
            scores[j] = s
        if not scores:
            continue
        m = max(scores.values())
        z = sum(math.exp(s - m) for s in scores.values())
        lse[b, h, i] = m + math.log(z)
        for j, s in scores.items():
            out[b, i, h] += math.exp(s - m) / z * torch.tensor(vs[b][j][kv_head], dtype=torch.float64)
    return out, lse


def randn(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


# (id, seqlen_q, seqlen_k, nheads, nheads_k, attention kwargs)
CASES = [
    ("plain", 5, 7, 4, 4, {}),
    ("sq>sk", 7, 5, 4, 4, {}),
    ("causal_sq<sk", 5, 9, 4, 4, {"causal": True}),
    ("causal_sq>sk", 9, 5, 4, 4, {"causal": True}),
    ("causal_sq=sk", 6, 6, 4, 4, {"causal": True}),
    ("local_2_1", 7, 9, 4, 4, {"window_size": (2, 1)}),
    ("local_2_1_sq>sk", 9, 6, 4, 4, {"window_size": (2, 1)}),
    ("local_0_0", 6, 8, 4, 4, {"window_size": (0, 0)}),
    ("local_inf_2", 8, 6, 4, 4, {"window_size": (-1, 2)}),
    ("local_3_inf", 6, 8, 4, 4, {"window_size": (3, -1)}),
    ("causal_left2", 6, 8, 4, 4, {"causal": True, "window_size": (2, -1)}),
    ("softcap", 5, 7, 4, 4, {"softcap": 2.0, "softmax_scale": 1.0}),
    ("alibi_h", 5, 8, 4, 4, {"alibi": "h"}),
    ("alibi_bh_causal_sq<sk", 5, 8, 4, 4, {"alibi": "bh", "causal": True}),
    ("alibi_bh_causal_sq>sk", 8, 5, 4, 4, {"alibi": "bh", "causal": True}),
    ("alibi_softcap_local", 7, 7, 4, 4, {"alibi": "h", "softcap": 1.5, "softmax_scale": 1.0, "window_size": (3, 1)}),
    ("gqa", 5, 7, 4, 2, {}),
    ("gqa_causal_sq>sk", 7, 5, 4, 2, {"causal": True}),
    ("mqa_local", 6, 9, 4, 1, {"window_size": (1, 2)}),
    ("softmax_scale", 5, 7, 4, 4, {"softmax_scale": 0.3}),
    ("seqlen_1", 1, 1, 4, 4, {"causal": True}),
]


def make_case(seqlen_q, seqlen_k, nheads, nheads_k, kwargs, batch=2, head_dim=8):
    q = randn(batch, seqlen_q, nheads, head_dim)
    k = randn(batch, seqlen_k, nheads_k, head_dim)
    v = randn(batch, seqlen_k, nheads_k, head_dim)
    kwargs = dict(kwargs)
    alibi = kwargs.pop("alibi", None)
    if alibi == "h":
        kwargs["alibi_slopes"] = generate_alibi_slopes(nheads)
    elif alibi == "bh":
        kwargs["alibi_slopes"] = torch.rand(batch, nheads) * 0.5
    return q, k, v, kwargs


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("reorder_ops", [False, True], ids=["scale_q", "scale_k"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reference_matches_naive_loop(case, reorder_ops):
    _, seqlen_q, seqlen_k, nheads, nheads_k, kwargs = case
    q, k, v, kwargs = make_case(seqlen_q, seqlen_k, nheads, nheads_k, kwargs)
    out, lse = attention_ref(q, k, v, reorder_ops=reorder_ops, **kwargs)
    out_naive, lse_naive = naive_attention(q, k, v, **kwargs)
    assert out.dtype == lse.dtype == torch.float64
    assert lse.shape == (q.shape[0], nheads, seqlen_q)
    torch.testing.assert_close(out, out_naive, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, lse_naive, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize(
    "kwargs, masked_rows",
    [
        ({"causal": True}, 4),               # sq=7, sk=3: rows i < sq - sk see nothing
        ({"window_size": (0, 0)}, 4),        # only key i - 4, missing for i < 4
        ({"window_size": (0, 1)}, 3),        # keys i - 4 .. i - 3
    ],
    ids=["causal", "local_0_0", "local_0_1"],
)
def test_fully_masked_rows_are_zero_with_neginf_lse(kwargs, masked_rows):
    q, k, v = randn(2, 7, 4, 8), randn(2, 3, 4, 8), randn(2, 3, 4, 8)
    out, lse = attention_ref(q, k, v, **kwargs)
    assert torch.isfinite(out).all()
    assert (out[:, :masked_rows] == 0).all()
    assert (out[:, masked_rows:].abs().amax(dim=(0, 2, 3)) > 0).all()
    assert torch.isneginf(lse[:, :, :masked_rows]).all()
    assert torch.isfinite(lse[:, :, masked_rows:]).all()


@pytest.mark.parametrize("upcast", [True, False])
def test_seqlen_k_zero_gives_zeros(upcast):
    q, k, v = randn(2, 5, 4, 8, dtype=torch.bfloat16), randn(2, 0, 2, 8, dtype=torch.bfloat16), randn(2, 0, 2, 8, dtype=torch.bfloat16)
    out, lse = attention_ref(q, k, v, causal=True, upcast=upcast)
    assert out.shape == q.shape and (out == 0).all()
    assert lse.shape == (2, 4, 5) and torch.isneginf(lse).all()


@pytest.mark.parametrize(
    "dtype, atol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)], ids=["bf16", "fp16"]
)
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"causal": True}, {"softcap": 5.0, "softmax_scale": 0.5}, {"alibi_slopes": generate_alibi_slopes(4)}],
    ids=["plain", "causal", "softcap", "alibi"],
)
def test_upcast_false_is_low_precision_but_close(dtype, atol, kwargs):
    q, k, v = randn(2, 33, 4, 32, dtype=dtype), randn(2, 47, 4, 32, dtype=dtype), randn(2, 47, 4, 32, dtype=dtype)
    out_ref, lse_ref = attention_ref(q, k, v, **kwargs)
    out_pt, lse_pt = attention_ref(q, k, v, upcast=False, **kwargs)
    assert out_pt.dtype == dtype and lse_pt.dtype == torch.float32
    err = (out_pt.double() - out_ref).abs().max().item()
    assert 0 < err <= atol  # nonzero: it really rounded in the input dtype
    torch.testing.assert_close(lse_pt.double(), lse_ref, atol=atol, rtol=0)


def test_compute_dtype():
    q = k = v = randn(1, 4, 2, 8, dtype=torch.float16)
    assert attention_ref(q, k, v)[0].dtype == torch.float64
    out, lse = attention_ref(q, k, v, dtype=torch.float32)
    assert out.dtype == lse.dtype == torch.float32
    with pytest.raises(ValueError, match="upcast=True"):
        attention_ref(q, k, v, upcast=False, dtype=torch.float32)


@pytest.mark.parametrize(
    "shapes, kwargs, match",
    [
        (((1, 4, 3, 8), (1, 4, 2, 8)), {}, "multiple of nheads_k"),
        (((1, 4, 2, 8), (1, 4, 2, 16)), {}, "head_dim"),
        (((1, 4, 2, 8), (1, 4, 2, 8)), {"alibi_slopes": torch.ones(3)}, "alibi_slopes"),
        (((1, 4, 2, 8), (1, 4, 2, 8)), {"window_size": (-2, 0)}, "window_size"),
    ],
    ids=["nheads", "head_dim", "alibi_shape", "window"],
)
def test_bad_arguments_raise(shapes, kwargs, match):
    q_shape, kv_shape = shapes
    with pytest.raises(ValueError, match=match):
        attention_ref(randn(*q_shape), randn(*kv_shape), randn(*kv_shape), **kwargs)


def _outputs(dtype=torch.bfloat16):
    q, k, v = (randn(2, 17, 4, 16, dtype=dtype) for _ in range(3))
    return attention_ref(q, k, v)[0], attention_ref(q, k, v, upcast=False)[0]


def test_fa_rule_accepts_an_output_as_good_as_pytorch():
    out_ref, out_pt = _outputs()
    assert_close_fa_rule(out_pt, out_ref, out_pt)
    assert_close_fa_rule(out_ref.to(torch.bfloat16), out_ref, out_pt)


def test_fa_rule_rejects_one_wrong_element():
    out_ref, out_pt = _outputs()
    pt_err = (out_pt.double() - out_ref).abs().max().item()
    out = out_ref.clone()
    out[1, 5, 2, 7] += 3 * pt_err
    with pytest.raises(AssertionError, match=r"at index \(1, 5, 2, 7\)"):
        assert_close_fa_rule(out, out_ref, out_pt)


def test_fa_rule_rejects_nan_and_shape_mismatch():
    out_ref, out_pt = _outputs()
    out = out_pt.clone()
    out[0, 3, 1, 2] = float("nan")
    with pytest.raises(AssertionError, match=r"NaN/inf; first at index \(0, 3, 1, 2\)"):
        assert_close_fa_rule(out, out_ref, out_pt)
    with pytest.raises(AssertionError, match="shape"):
        assert_close_fa_rule(out_pt[:, :5], out_ref, out_pt)


def test_lse_check():
    lse_ref = torch.tensor([[[-math.inf, 1.0, 20.0]]], dtype=torch.float64)
    assert_lse_close(torch.tensor([[[-math.inf, 1.0005, 20.01]]]), lse_ref)
    with pytest.raises(AssertionError, match="-inf pattern"):
        assert_lse_close(torch.tensor([[[0.0, 1.0, 20.0]]]), lse_ref)
    with pytest.raises(AssertionError, match="-inf pattern"):
        assert_lse_close(torch.tensor([[[-math.inf, -math.inf, 20.0]]]), lse_ref)
    with pytest.raises(AssertionError, match="NaN"):
        assert_lse_close(torch.tensor([[[float("nan"), 1.0, 20.0]]]), lse_ref)
    with pytest.raises(AssertionError, match=r"at index \(0, 0, 1\)"):
        assert_lse_close(torch.tensor([[[-math.inf, 1.01, 20.0]]]), lse_ref)


def test_alibi_slopes():
    torch.testing.assert_close(generate_alibi_slopes(8), torch.tensor([2.0 ** -i for i in range(1, 9)]))
    slopes12 = generate_alibi_slopes(12)
    expected = [2.0 ** -i for i in range(1, 9)] + [2.0 ** -(i + 0.5) for i in range(4)]
    assert slopes12.dtype == torch.float32
    torch.testing.assert_close(slopes12, torch.tensor(expected))
    torch.testing.assert_close(generate_alibi_slopes(1), torch.tensor([2.0 ** -8]))


def test_attention_flops():
    fwd = 4 * 2 * 8 * 128 * 256 * 64
    assert attention_flops(2, 8, 128, 256, 64, causal=False) == fwd
    assert attention_flops(2, 8, 128, 256, 64, causal=True) == fwd / 2
    assert attention_flops(2, 8, 128, 256, 64, causal=False, mode="bwd") == 2.5 * fwd
    assert attention_flops(2, 8, 128, 256, 64, causal=True, mode="fwd_bwd") == 3.5 * fwd / 2
    with pytest.raises(ValueError, match="mode"):
        attention_flops(2, 8, 128, 256, 64, causal=False, mode="both")
