"""GPU tier: PackGQA. Packed and unpacked outputs each meet FlashAttention's rule against the
reference and agree with each other, across MQA and GQA 4/8/16, seqlen_q 1/3/64/1000, the masks,
softcap and ALiBi, d 64/128/256, fp16 and bf16.

Not a Cartesian product (each combination is an instance compile): every (group size, seqlen_q)
pair runs once, and the feature, head dim and dtype rotate through those runs so that each value
of each axis appears several times.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from flashgen.testing import assert_lse_close, generate_alibi_slopes
from test_fwd import DTYPE_NAMES, _seed, check_fwd, make_qkv  # noqa: F401 (_seed: autouse seeding)

pytestmark = pytest.mark.gpu

GROUPS = {"mqa16": (16, 1), "gqa4": (8, 2), "gqa8": (16, 2), "gqa16": (32, 2)}  # (nheads, nheads_k)
SEQLENS_Q = (1, 3, 64, 1000)
FEATURES = ("causal", "local", "softcap", "alibi", "none")
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)


def _cases():
    # Axes of coprime lengths (5, 3, 2) rotate independently: 16 runs reach every value often.
    for i, ((group, (nheads, nheads_k)), seqlen_q) in enumerate(itertools.product(GROUPS.items(), SEQLENS_Q)):
        feature, head_dim, dtype = FEATURES[i % 5], HEAD_DIMS[i % 3], DTYPES[i % 2]
        yield pytest.param(
            nheads, nheads_k, seqlen_q, feature, head_dim, dtype,
            id=f"{group}-sq{seqlen_q}-{feature}-d{head_dim}-{DTYPE_NAMES[dtype]}",
        )


def _feature_kwargs(feature, nheads):
    if feature == "causal":
        return {"causal": True}
    if feature == "local":
        return {"window_size": (40, 5)}
    if feature == "softcap":
        return {"softcap": 5.0, "softmax_scale": 0.25}
    if feature == "alibi":
        return {"alibi_slopes": generate_alibi_slopes(nheads, device="cuda"), "causal": True}
    return {}


@pytest.mark.parametrize("nheads, nheads_k, seqlen_q, feature, head_dim, dtype", list(_cases()))
def test_packed_and_unpacked_agree(nheads, nheads_k, seqlen_q, feature, head_dim, dtype):
    seqlen_k = 1000 if seqlen_q == 1000 else 517
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype=dtype)
    kwargs = _feature_kwargs(feature, nheads)
    packed = check_fwd(q, k, v, name="out(pack_gqa=True)", pack_gqa=True, **kwargs)
    unpacked = check_fwd(q, k, v, name="out(pack_gqa=False)", pack_gqa=False, **kwargs)
    # Same arithmetic in the same order per row: the two layouts may differ only in rounding.
    tolerance = 2 * (unpacked.out_pt.float() - unpacked.out_ref).abs().max().item() + 1e-5
    assert (packed.out.float() - unpacked.out.float()).abs().max().item() <= tolerance
    assert_lse_close(packed.lse, unpacked.lse, name="lse packed vs unpacked")
