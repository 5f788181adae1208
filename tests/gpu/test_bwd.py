"""GPU tier: the backward pass (dq, dk, dv) of flash_attn_func and its packed variants.

Rule (FlashAttention's tests/test_flash_attn.py): each gradient is finite and
    max |g - g_ref| <= K * max |g_pt - g_ref| + eps
where g_ref comes from torch autograd through attention_ref on float32 leaf copies of q, k, v
(upcast=True) and g_pt from the same autograd on leaves in the input dtype (upcast=False); all
three backward passes (flashgen's included) get the same fixed random dout.  K = 3 as in
FlashAttention; with softcap K = 4, as FlashAttention-3's tests loosen the factor for softcap: the
kernel multiplies dS by an fp32 1 - tanh², where PyTorch's chain of low-precision ops rounds
differently.  eps = 1e-4 * max(1, max |g_ref|) is a floor for gradients that are exactly 0 in exact
arithmetic (dq and dk when seqlen_k == 1: P is 1, dS is 0), where PyTorch's error can be 0 too.

The caching allocator is poisoned with NaN right before each flashgen backward: dq, dk, dv come
from torch.empty_like, so an element the kernels fail to write shows up as NaN.

Not a Cartesian product (each (dtype, instance head dim, mask, softcap) costs an NVRTC compile of a
forward and a backward instance): every head dim meets every mask once with the dtype rotating,
then targeted tests for sequence lengths, GQA/MQA, softcap, ALiBi, layouts, determinism,
torch.library.opcheck and torch.compile.
"""
from __future__ import annotations

import copy
import itertools
import math
import os
import pathlib
import subprocess
import sys
import typing

import pytest
import torch

import flashgen
from flashgen.testing import assert_close_fa_rule, attention_ref, generate_alibi_slopes
from test_fwd import DEVICE, DTYPE_NAMES, MASKS, alibi_slopes, make_qkv, poison_allocator, randn, seqlen_params
from test_fwd import _seed  # noqa: F401  (autouse: a seed per test id)

pytestmark = pytest.mark.gpu

DTYPE_LIST = [torch.float16, torch.bfloat16]
DTYPES = [pytest.param(dtype, id=DTYPE_NAMES[dtype]) for dtype in DTYPE_LIST]
REPO = pathlib.Path(__file__).resolve().parents[2]


# --- gradients and the rule -------------------------------------------------------------------------

def flash_grads(fn, inputs, dout, **kwargs):
    """Gradients of fn(*inputs, **kwargs) for the output gradient dout, the backward run on a
    poisoned allocator."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = fn(*leaves, **kwargs)
    poison_allocator()
    return torch.autograd.grad(out, leaves, dout)


def ref_grads(q, k, v, dout, upcast, **kwargs):
    """dq, dk, dv through attention_ref: float32 leaves if upcast, else leaves in the input dtype."""
    leaves = [(x.float() if upcast else x).detach().requires_grad_() for x in (q, k, v)]
    out, _ = attention_ref(*leaves, upcast=upcast, **kwargs)
    return torch.autograd.grad(out, leaves, dout.to(out.dtype))


class Checked(typing.NamedTuple):
    dout: torch.Tensor
    grads_ref: tuple
    grads_pt: tuple
    rule_k: float


def grad_eps(g_ref: torch.Tensor) -> float:
    return 1e-4 * max(1.0, g_ref.abs().max().item() if g_ref.numel() else 0.0)


def check_grads(q, k, v, dout, grads, **kwargs) -> Checked:
    """Hold flashgen's (dq, dk, dv) to the float32 reference by FlashAttention's rule."""
    grads_ref = ref_grads(q, k, v, dout, upcast=True, **kwargs)
    grads_pt = ref_grads(q, k, v, dout, upcast=False, **kwargs)
    rule_k = 4.0 if kwargs.get("softcap") else 3.0
    for name, g, g_ref, g_pt, x in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
        assert_close_fa_rule(g, g_ref, g_pt, k=rule_k, eps=grad_eps(g_ref), name=name)
    return Checked(dout, grads_ref, grads_pt, rule_k)


def check_bwd(q, k, v, **kwargs) -> Checked:
    dout = torch.randn_like(q)
    grads = flash_grads(flashgen.flash_attn_func, (q, k, v), dout, **kwargs)
    return check_grads(q, k, v, dout, grads, **kwargs)


def assert_grads_feature_matters(q, k, v, checked: Checked, **kwargs_without_feature) -> None:
    """The reference's gradients without the feature must fail the rule (in dq, dk or dv);
    otherwise a backward that ignored the feature would pass the test."""
    without = ref_grads(q, k, v, checked.dout, upcast=True, **kwargs_without_feature)
    passes = []
    for g, g_ref, g_pt in zip(without, checked.grads_ref, checked.grads_pt):
        try:
            assert_close_fa_rule(g, g_ref, g_pt, k=checked.rule_k, eps=grad_eps(g_ref))
            passes.append(True)
        except AssertionError:
            passes.append(False)
    assert not all(passes), "gradients without the feature pass the rule: the test cannot see the feature"


# --- dtype x head dim x mask, sequence lengths ------------------------------------------------------

# Instance head dims (above 128 the dK/dV/dQ columns are split over two CTAs per key block), then
# dims that run on a larger instance with the columns past them predicated off.
INSTANCE_DIMS = [64, 96, 128, 192, 256]
OFF_INSTANCE_DIMS = {72: 96, 200: 256}


def _dim_mask_cases():
    # The dtype alternates along both axes, so each instance dim meets both dtypes across the
    # masks; an off-instance dim takes its instance's dtype per mask, reusing those compiles.
    for head_dim in INSTANCE_DIMS + list(OFF_INSTANCE_DIMS):
        i = INSTANCE_DIMS.index(OFF_INSTANCE_DIMS.get(head_dim, head_dim))
        for j, mask in enumerate(MASKS):
            dtype = DTYPE_LIST[(i + j) % 2]
            yield pytest.param(dtype, head_dim, mask, id=f"{DTYPE_NAMES[dtype]}-d{head_dim}-{mask}")


@pytest.mark.parametrize("dtype, head_dim, mask", list(_dim_mask_cases()))
def test_bwd_dtype_dim_mask(dtype, head_dim, mask):
    q, k, v = make_qkv(2, 177, 255, 4, 4, head_dim, dtype)
    check_bwd(q, k, v, **MASKS[mask])


# On Hopper the sm80 family runs the backward of d > 128, deterministic and seqused calls; compiled
# for sm_90 it adds dQ from a shared tile by bulk reductions (BwdTile.dq_tile), one per query row
# below seqlen_q, of head_dim columns. Forced here for head dims the sm90 backward would take (on
# other GPUs the sm80 family runs anyway): partial last blocks, head dims below their instance's,
# GQA/MQA, a query block with one row.
@pytest.mark.parametrize("head_dim, nheads_k, mask, seqlen_q, seqlen_k", [
    pytest.param(64, 4, "none", 1023, 255, id="d64-sq1023-sk255"),
    pytest.param(72, 2, "causal", 113, 300, id="d72-gqa4_2-causal-sq113-sk300"),
    pytest.param(128, 1, "local", 300, 113, id="d128-mqa4_1-local-sq300-sk113"),
    pytest.param(120, 4, "causal", 1, 255, id="d120-causal-sq1-sk255"),
])
def test_bwd_sm80_family_forced(monkeypatch, head_dim, nheads_k, mask, seqlen_q, seqlen_k):
    monkeypatch.setenv("FLASHGEN_FAMILY", "sm80")
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, nheads_k, head_dim)
    check_bwd(q, k, v, **MASKS[mask])


# sq > sk with causal or local leaves the first rows with no visible key (lse -inf: their dq is 0
# and they add nothing to dk, dv); keys no query sees must still get dk = dv = 0.
ODD_SEQLENS = [(1, 1), (1, 255), (17, 1023), (113, 113), (113, 255), (255, 113), (1023, 255), (1023, 1023), (255, 1)]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("seqlen_q, seqlen_k", seqlen_params(ODD_SEQLENS))
def test_bwd_odd_seqlens(seqlen_q, seqlen_k, mask):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 4, 128)
    check_bwd(q, k, v, **MASKS[mask])


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(17, 0), (0, 17)], ids=["sk0", "sq0"])
def test_bwd_empty_seqlen(seqlen_q, seqlen_k):
    # seqlen_k == 0: every output row is 0 whatever q is, so dq is 0; seqlen_q == 0: dk = dv = 0.
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 4, 64)
    dq, dk, dv = flash_grads(flashgen.flash_attn_func, (q, k, v), torch.randn_like(q), causal=True)
    for name, g, x in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert g.shape == x.shape and (g == 0).all(), name


# --- GQA / MQA, softcap, ALiBi ------------------------------------------------------------------------

def _gqa_cases():
    # dK/dV are summed over each KV head's query heads inside the kernel. The head dim shifts by one
    # between the groups, so each group meets 64, 128 and 256 with a different mask; dtype and
    # seqlens alternate.
    groups = {"gqa8_2": 2, "mqa8_1": 1}
    for i, ((group, nheads_k), mask) in enumerate(itertools.product(groups.items(), MASKS)):
        head_dim, dtype = (64, 128, 256)[(i + i // 3) % 3], DTYPE_LIST[i % 2]
        seqlen_q, seqlen_k = ((113, 300), (300, 113))[(i // 2) % 2]
        yield pytest.param(
            nheads_k, mask, head_dim, dtype, seqlen_q, seqlen_k,
            id=f"{group}-{mask}-d{head_dim}-{DTYPE_NAMES[dtype]}-sq{seqlen_q}-sk{seqlen_k}",
        )


@pytest.mark.parametrize("nheads_k, mask, head_dim, dtype, seqlen_q, seqlen_k", list(_gqa_cases()))
def test_bwd_gqa(nheads_k, mask, head_dim, dtype, seqlen_q, seqlen_k):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 8, nheads_k, head_dim, dtype)
    check_bwd(q, k, v, **MASKS[mask])


# Cap 5 with scores scaled up (softmax_scale = 2 / sqrt(d)): 1 - tanh² is far from 1, so a
# backward that dropped it fails the rule (checked by assert_grads_feature_matters).
@pytest.mark.parametrize(
    "dtype, head_dim, mask, nheads_k",
    [
        pytest.param(torch.float16, 64, "none", 4, id="fp16-d64-none"),
        pytest.param(torch.bfloat16, 128, "causal", 4, id="bf16-d128-causal"),
        pytest.param(torch.bfloat16, 256, "local", 2, id="bf16-d256-local-gqa4_2"),
    ],
)
def test_bwd_softcap(dtype, head_dim, mask, nheads_k):
    q, k, v = make_qkv(2, 177, 255, 4, nheads_k, head_dim, dtype)
    kwargs = dict(softmax_scale=2.0 / math.sqrt(head_dim), **MASKS[mask])
    checked = check_bwd(q, k, v, softcap=5.0, **kwargs)
    assert_grads_feature_matters(q, k, v, checked, **kwargs)


@pytest.mark.parametrize("seqlen_q, seqlen_k", seqlen_params([(113, 300), (300, 113)]))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("slopes_shape", ["h", "bh"], ids=["slopes_h", "slopes_bh"])
def test_bwd_alibi(slopes_shape, mask, seqlen_q, seqlen_k):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 4, 128)
    checked = check_bwd(q, k, v, alibi_slopes=alibi_slopes(slopes_shape, 2, 4), **MASKS[mask])
    assert_grads_feature_matters(q, k, v, checked, **MASKS[mask])


def test_bwd_gqa_softcap_alibi():
    """Softcap before ALiBi, each query head's own slope, and the GQA sum over the group at once."""
    q, k, v = make_qkv(2, 300, 255, 8, 2, 128)
    slopes = alibi_slopes("bh", 2, 8)
    kwargs = {"causal": True, "softmax_scale": 2.0 / math.sqrt(128)}
    checked = check_bwd(q, k, v, softcap=5.0, alibi_slopes=slopes, **kwargs)
    assert_grads_feature_matters(q, k, v, checked, alibi_slopes=slopes, **kwargs)
    assert_grads_feature_matters(q, k, v, checked, softcap=5.0, **kwargs)


# --- layouts and extreme values -------------------------------------------------------------------------

@pytest.mark.parametrize("nheads_k, mask", [(4, "none"), (2, "causal")], ids=["mha-none", "gqa-causal"])
def test_bwd_noncontiguous_inputs(nheads_k, mask):
    batch, seqlen_q, seqlen_k, nheads, head_dim = 2, 113, 255, 4, 128
    # q and v are not dense (empty_like gives contiguous dq, dv); k is dense but permuted, so
    # empty_like gives dk k's permuted strides and the kernel must write through them.
    q = randn(batch, seqlen_q + 6, nheads, head_dim + 8)[:, 3 : 3 + seqlen_q, :, :head_dim]
    k = randn(batch, nheads_k, seqlen_k, head_dim).transpose(1, 2)
    v = randn(batch, seqlen_k, nheads_k, 2 * head_dim)[..., head_dim:]
    check_bwd(q, k, v, **MASKS[mask])


def _loss_and_dout(out: torch.Tensor, layout: str):
    """A loss whose gradient reaches flashgen's backward as a dout of the given layout, and the
    same dout made contiguous."""
    def rand(*shape):
        return torch.randn(*shape, dtype=out.dtype, device=out.device)

    if layout == "expanded":  # out.sum(): SumBackward expands a scalar, every stride 0
        return out.sum(), torch.ones_like(out)
    if layout == "transposed":  # stride(-1) = nheads; its head stride of 1 is not 8-aligned
        w = rand(*out.shape[:2], out.shape[3], out.shape[2])
        return (out.transpose(-1, -2) * w).sum(), w.transpose(-1, -2).contiguous()
    # "interleaved": out stacked with another tensor on a new last dim (as real/imag pairs are):
    # StackBackward selects every other element, stride(-1) = 2 and every other stride 8-aligned.
    w = rand(*out.shape, 2)
    return (torch.stack((out, torch.zeros_like(out)), dim=-1) * w).sum(), w[..., 0].contiguous()


@pytest.mark.parametrize("layout", ["expanded", "transposed", "interleaved"])
def test_bwd_noncontiguous_dout(layout):
    """Autograd hands the backward whatever layout the next op's backward made. The kernels read
    dO rows in 16-byte chunks, so a dout whose last dim is not contiguous must be copied first."""
    q, k, v = make_qkv(2, 113, 255, 4, 4, 64)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = flashgen.flash_attn_func(*leaves, causal=True)
    seen = []
    out.register_hook(seen.append)
    loss, dout = _loss_and_dout(out, layout)
    poison_allocator()
    grads = torch.autograd.grad(loss, leaves)
    assert seen[0].stride(-1) != 1, f"dout has strides {seen[0].stride()}: the test needs a non-contiguous one"
    check_grads(q, k, v, dout, grads, causal=True)


@pytest.mark.parametrize("misaligned", ["out", "dq", "both", "dk_dv"])
@pytest.mark.parametrize("head_dim", [64, 72, 256])
def test_bwd_unaligned_tensors(misaligned, head_dim):
    """The preprocess reads O and dO and the postprocess writes dQ in 16-byte chunks when their
    pointers and strides allow it, element by element otherwise; the main kernels write dK and dV
    in chunks always, into dense buffers (copied back) for a dk or dv off them. The backward op
    called directly with an out one element off a chunk boundary, and a dq (or dk and dv) whose
    strides are not whole chunks, gives the same gradients as with dense ones (the element loop is
    exact: it sums in another order)."""
    q, k, v = make_qkv(2, 113, 255, 4, 2, head_dim)
    out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dout = randn(*out.shape)
    scale = 1 / math.sqrt(head_dim)

    def run(out_arg, dq, dk=None, dv=None):
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        torch.ops.flashgen.bwd(dout, q, k, v, out_arg, lse, dq, dk, dv, scale, True, -1, -1, 0.0, None, 0.0,
                               torch.zeros(2, dtype=torch.int64, device=DEVICE), False)
        return dq, dk, dv

    expected = run(out, torch.empty_like(q))
    out_arg, dq = out, torch.empty_like(q)
    if misaligned in ("out", "both"):
        storage = torch.empty(out.numel() + 1, dtype=out.dtype, device=DEVICE)
        out_arg = storage[1:].view(out.shape)
        out_arg.copy_(out)
        assert out_arg.data_ptr() % 16 != 0
    if misaligned in ("dq", "both"):
        dq = torch.full((*q.shape[:-1], head_dim + 1), float("nan"), dtype=q.dtype, device=DEVICE)[..., :head_dim]
        assert dq.stride(-2) % 8 != 0
    dk = dv = None
    if misaligned == "dk_dv":
        dk, dv = (torch.full((*t.shape[:-1], head_dim + 1), float("nan"), dtype=t.dtype, device=DEVICE)[..., :head_dim]
                  for t in (k, v))
        assert dk.stride(-3) % 8 != 0
    got = run(out_arg, dq, dk, dv)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(g, e, atol=2e-3 * max(1.0, e.abs().max().item()), rtol=0, msg=name)


@pytest.mark.parametrize("mask", ["none", "local", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bwd_very_negative_scores(dtype, mask):
    """Every score near -128, so lse is near -125 and exp(-lse) overflows float32 (in fp16, dS
    overflows from lse below about -10). The key block holds zero-filled rows past seqlen_k = 17:
    their score is 0, and only masking them (as the forward does) keeps exp(0 - lse) = inf out of
    dS, where inf times a zero K row is NaN in dQ. No mask and the local window (whose right edge
    passes seqlen_k for the last rows) need that masking; causal masks those keys anyway: the
    control. The rule is loose here (bf16 rounds scores near -128 by up to 0.5); the point is
    finite, plausible gradients."""
    batch, seqlen_q, seqlen_k, nheads, head_dim = 2, 113, 17, 4, 128
    q = 1 + 0.1 * randn(batch, seqlen_q, nheads, head_dim, dtype=torch.float32)
    k = -1 - 0.1 * randn(batch, seqlen_k, nheads, head_dim, dtype=torch.float32)
    v = randn(batch, seqlen_k, nheads, head_dim, dtype=torch.float32)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    check_bwd(q, k, v, softmax_scale=1.0, **MASKS[mask])


# --- determinism --------------------------------------------------------------------------------------

PASSES = 10


def _determinism_case(nheads, nheads_k, seqlen_q, seqlen_k, head_dim, dtype, mask):
    group = "mha" if nheads == nheads_k else f"{'mqa' if nheads_k == 1 else 'gqa'}{nheads}_{nheads_k}"
    return pytest.param(
        nheads, nheads_k, seqlen_q, seqlen_k, head_dim, dtype, mask,
        id=f"{group}-{mask}-d{head_dim}-{DTYPE_NAMES[dtype]}-sq{seqlen_q}-sk{seqlen_k}",
    )


# seqlen_k 1023 gives 8-16 key blocks adding to each query block's dQ: plenty of atomics to reorder.
# The local case has sq > sk, so leading query blocks see no key and the window's left edge skips
# the first key blocks of the others.
DETERMINISM_CASES = [
    _determinism_case(4, 4, 300, 1023, 128, torch.float16, "none"),
    _determinism_case(8, 2, 300, 1023, 64, torch.bfloat16, "causal"),
    _determinism_case(8, 1, 1023, 511, 96, torch.bfloat16, "local"),
]


def deterministic_passes(q, k, v, dout, **kwargs) -> list[tuple[torch.Tensor, ...]]:
    """PASSES backward passes through one deterministic forward, each on a poisoned allocator."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = flashgen.flash_attn_func(*leaves, deterministic=True, **kwargs)
    passes = []
    for _ in range(PASSES):
        poison_allocator()
        passes.append(torch.autograd.grad(out, leaves, dout, retain_graph=True))
    return passes


def check_deterministic(q, k, v, dout, passes, **kwargs) -> None:
    for i, grads in enumerate(passes[1:], 1):
        for name, g, g0 in zip(("dq", "dk", "dv"), grads, passes[0]):
            assert torch.equal(g, g0), f"{name} of deterministic pass {i} differs from pass 0"
    check_grads(q, k, v, dout, passes[0], **kwargs)
    # The non-deterministic mode adds the same fp32 terms to dQ in another order: equal up to the
    # input dtype's rounding of slightly different fp32 sums.
    free = flash_grads(flashgen.flash_attn_func, (q, k, v), dout, **kwargs)
    for name, g, g_free in zip(("dq", "dk", "dv"), passes[0], free):
        torch.testing.assert_close(
            g, g_free, rtol=torch.finfo(g.dtype).eps, atol=1e-4 * g_free.abs().max().item(),
            msg=lambda m, name=name: f"{name}, deterministic vs not: {m}",
        )


@pytest.mark.parametrize("nheads, nheads_k, seqlen_q, seqlen_k, head_dim, dtype, mask", DETERMINISM_CASES)
def test_bwd_deterministic(nheads, nheads_k, seqlen_q, seqlen_k, head_dim, dtype, mask):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    dout = torch.randn_like(q)
    passes = deterministic_passes(q, k, v, dout, **MASKS[mask])
    check_deterministic(q, k, v, dout, passes, **MASKS[mask])


# Runs in a child process: in deterministic mode each CTA spins on a semaphore until the key
# blocks before it have added to dQ, so an ordering bug hangs the GPU instead of failing, and a
# hung kernel cannot be interrupted in this process.
_CHILD = """
import sys, torch, flashgen
from flashgen.generator import tiles
if len(sys.argv) > 4:  # a backward tile for the head dim, "warps,block_m,d_slices"
    tiles._BWD_SM80_LARGE[int(sys.argv[4])] = tiles.BwdTile(*map(int, sys.argv[5].split(",")))
data = torch.load(sys.argv[1])
leaves = [data[n].requires_grad_() for n in ("q", "k", "v")]
out = flashgen.flash_attn_func(*leaves, deterministic=True, **data["kwargs"])
passes = [torch.autograd.grad(out, leaves, data["dout"], retain_graph=True) for _ in range(int(sys.argv[3]))]
torch.cuda.synchronize()
torch.save(passes, sys.argv[2])
"""
CHILD_TIMEOUT_S = 90


def test_bwd_deterministic_head_dim_slices(tmp_path):
    """Head-dim slices (the d256 tile of 99 KB targets, forced here): two CTAs per key block (one
    per half of the head dim) both add to dQ under the deterministic ordering, so the ordering must
    count per slice."""
    q, k, v = make_qkv(2, 300, 1023, 8, 2, 256)
    dout = torch.randn_like(q)
    kwargs = {"causal": True}
    inputs, outputs = tmp_path / "inputs.pt", tmp_path / "passes.pt"
    torch.save({"q": q, "k": k, "v": v, "dout": dout, "kwargs": kwargs}, inputs)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, str(inputs), str(outputs), str(PASSES), "256", "4,64,2"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"deterministic backward (d256, GQA, causal) still running after {CHILD_TIMEOUT_S} s: "
                    "a CTA waits on a dQ semaphore that never reaches its value")
    assert child.returncode == 0, child.stderr[-4000:]
    check_deterministic(q, k, v, dout, torch.load(outputs), **kwargs)


# --- packed variants ------------------------------------------------------------------------------

def test_bwd_qkvpacked():
    qkv = randn(2, 255, 3, 4, 64)
    dout = randn(2, 255, 4, 64)
    (dqkv,) = flash_grads(flashgen.flash_attn_qkvpacked_func, (qkv,), dout, causal=True)
    assert dqkv.shape == qkv.shape
    check_grads(*qkv.unbind(2), dout, dqkv.unbind(2), causal=True)


def test_bwd_kvpacked():
    q, kv = randn(2, 300, 8, 64), randn(2, 113, 2, 2, 64)
    dout = torch.randn_like(q)
    dq, dkv = flash_grads(flashgen.flash_attn_kvpacked_func, (q, kv), dout, window_size=(33, 7))
    assert dkv.shape == kv.shape
    check_grads(q, *kv.unbind(2), dout, (dq, *dkv.unbind(2)), window_size=(33, 7))


# --- torch.library and torch.compile ------------------------------------------------------------------

OPCHECK_SAMPLES = {
    # (softmax_scale, causal, window_left, window_right, softcap, alibi_slopes (per nheads=4) or None)
    "gqa-causal": (0.125, True, -1, -1, 0.0, False),
    "local-softcap-alibi": (0.25, False, 33, 7, 5.0, True),
}


def _opcheck_fwd_args(sample):
    flashgen.flash_attn_func  # noqa: B018  (imports flashgen.runtime.interface, which registers the ops)
    softmax_scale, causal, window_left, window_right, softcap, alibi = OPCHECK_SAMPLES[sample]
    q, k, v = make_qkv(2, 77, 129, 4, 2, 64)
    slopes = generate_alibi_slopes(4, device=q.device) if alibi else None
    # deterministic=True: opcheck compares gradients of eager and AOT-traced runs with
    # assert_close's fp16/bf16 tolerances, which dQ's atomic reordering could exceed by an ulp.
    return q, k, v, softmax_scale, causal, window_left, window_right, softcap, slopes, None, 1, 0.0, True


@pytest.mark.parametrize("sample", OPCHECK_SAMPLES)
def test_opcheck_fwd(sample):
    # All default checks: schema, autograd registration, fake tensor, and AOT dispatch with dynamic
    # shapes, which also runs the registered backward (flashgen::bwd) against eager. Its gradient
    # check back-propagates out.sum(), so eager feeds the backward an expanded dout (see
    # test_bwd_noncontiguous_dout) while AOTAutograd makes the tangent contiguous.
    q, k, v, *options = _opcheck_fwd_args(sample)
    args = (*(x.requires_grad_() for x in (q, k, v)), *options)
    torch.library.opcheck(torch.ops.flashgen.fwd.default, args)


@pytest.mark.parametrize("sample", OPCHECK_SAMPLES)
def test_opcheck_bwd(sample):
    # All default checks apply to the mutating op too: opcheck copies every tensor argument before
    # each check, so each run writes fresh dq, dk, dv; the schema check verifies that only those
    # three are written. (No input requires grad: the backward op has no autograd of its own.)
    q, k, v, softmax_scale, causal, window_left, window_right, softcap, slopes, _, _, dropout_p, deterministic = (
        _opcheck_fwd_args(sample))
    out, lse, rng_state = torch.ops.flashgen.fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                                 slopes, None, 1, dropout_p, deterministic)
    args = (torch.randn_like(out), q, k, v, out, lse, torch.empty_like(q), torch.empty_like(k),
            torch.empty_like(v), softmax_scale, causal, window_left, window_right, softcap, slopes, dropout_p,
            rng_state, deterministic)
    torch.library.opcheck(torch.ops.flashgen.bwd.default, args)


class AttentionBlock(torch.nn.Module):
    def __init__(self, dim: int, nheads: int):
        super().__init__()
        self.nheads = nheads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        batch, seqlen, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seqlen, 3, self.nheads, dim // self.nheads).unbind(2)
        out = flashgen.flash_attn_func(q, k, v, causal=True)
        return self.proj(out.reshape(batch, seqlen, dim))


def test_torch_compile_fullgraph():
    """fullgraph=True raises on any graph break, e.g. if dynamo cannot trace flash_attn_func's
    argument checks or the custom ops' fake implementations fail."""
    torch._dynamo.reset()
    eager = AttentionBlock(256, 4).to(device=DEVICE, dtype=torch.bfloat16)
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, fullgraph=True)
    x = randn(2, 255, 256)
    dy = randn(2, 255, 256)  # a dense output gradient, so flashgen's dout is dense too

    def run(fn, module):
        xi = x.detach().requires_grad_()
        y = fn(xi)
        y.backward(dy)
        return [y.detach(), xi.grad] + [p.grad for p in module.parameters()]

    results = run(compiled, compiled_module)
    expected = run(eager, eager)
    # Same flashgen kernels both ways; only the linear layers' rounding (and dQ's atomic order) differ.
    for i, (got, want) in enumerate(zip(results, expected)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item(),
                                   msg=lambda m, i=i: f"result {i} (y, dx, then parameter grads): {m}")
