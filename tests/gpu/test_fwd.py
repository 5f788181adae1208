"""GPU tier: flash_attn_func and its packed variants against the reference, by FlashAttention's rule.

Every output must be finite and within k * (error of PyTorch in the input dtype) + 1e-5 of the
float32 reference (k = 2, or 3 with softcap); lse must match on finite entries and have -inf exactly
where a row sees no key.  Inputs are fresh torch.randn with a seed per test id; the caching allocator
is poisoned with NaN before each call, so an output element the kernel fails to write shows up.

The matrix is chosen to reach every instance family without a Cartesian product: (dtype x head_dim x
mask) in full on small shapes, then targeted tests for sequence lengths, windows, GQA / PackGQA,
softcap, ALiBi, strides, packed inputs, CUDA graphs and streams.
"""
from __future__ import annotations

import math
import typing
import zlib

import pytest
import torch

import flashgen
from flashgen.testing import assert_close_fa_rule, assert_lse_close, attention_ref, generate_alibi_slopes

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
DTYPES = [pytest.param(dtype, id=name) for dtype, name in DTYPE_NAMES.items()]
# Instance head dims, then dims that run on the next larger instance.
HEAD_DIMS = [64, 96, 128, 192, 256, 40, 72, 136, 200]
MASKS = {"none": {}, "causal": {"causal": True}, "local": {"window_size": (33, 7)}}
# Each instance head dim once per dtype across the two lists, so GQA and softcap tests between them
# reach every (dtype, head_dim) without doubling the number of compiled instances.
DTYPE_DIMS_A = [(torch.float16, 64), (torch.bfloat16, 96), (torch.float16, 128), (torch.bfloat16, 192), (torch.float16, 256)]
DTYPE_DIMS_B = [(torch.bfloat16, 64), (torch.float16, 96), (torch.bfloat16, 128), (torch.float16, 192), (torch.bfloat16, 256)]


def dtype_dim_params(pairs):
    return [pytest.param(dt, d, id=f"{DTYPE_NAMES[dt]}-d{d}") for dt, d in pairs]


def seqlen_params(pairs):
    return [pytest.param(sq, sk, id=f"sq{sq}-sk{sk}") for sq, sk in pairs]


@pytest.fixture(autouse=True)
def _seed(request):
    # Reproducible, and different for every test and parameter set.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def poison_allocator(reserve_bytes: int = 256 << 20) -> None:
    """Fill every free block of the caching allocator with NaN bytes, so the output and lse buffers
    that flash_attn_func allocates next start as NaN, never as stale plausible values (such as the
    previous call's correct output, freed into a segment that empty_cache cannot release)."""
    from cuda.bindings import driver

    torch.cuda.empty_cache()
    # Cached free memory in the large and the small pool (requests <= 1 MiB), for requests that no
    # existing free block fits; poisoned below with the rest.
    reserve = [torch.empty(reserve_bytes, dtype=torch.uint8, device=DEVICE)]
    reserve += [torch.empty(1 << 20, dtype=torch.uint8, device=DEVICE) for _ in range(4)]
    del reserve
    (err,) = driver.cuInit(0)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    stream = torch.cuda.current_stream().cuda_stream
    for segment in torch.cuda.memory_snapshot():
        if segment["device"] != torch.cuda.current_device():
            continue
        address = segment["address"]
        for block in segment["blocks"]:  # in address order, covering the segment
            if block["state"] == "inactive":
                # 0xFF bytes are NaN in fp16, bf16 and fp32.
                (err,) = driver.cuMemsetD8Async(address, 0xFF, block["size"], stream)
                assert err == driver.CUresult.CUDA_SUCCESS, err
            address += block["size"]


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype=torch.bfloat16):
    return (
        randn(batch, seqlen_q, nheads, head_dim, dtype=dtype),
        randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype),
        randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype),
    )


def call_poisoned(fn, *args, **kwargs):
    """(out, lse) of fn(*args, return_attn_probs=True, **kwargs) run on a poisoned allocator."""
    poison_allocator()
    out, lse, attn_probs = fn(*args, return_attn_probs=True, **kwargs)
    assert attn_probs is None
    return out, lse


class Checked(typing.NamedTuple):
    out: torch.Tensor
    lse: torch.Tensor
    out_ref: torch.Tensor
    out_pt: torch.Tensor
    rule_k: float


def check_against_ref(out, lse, q, k, v, name="out", **kwargs) -> Checked:
    """Hold (out, lse) to the float32 reference by FlashAttention's rule."""
    out_ref, lse_ref = attention_ref(q, k, v, **kwargs)
    out_pt, _ = attention_ref(q, k, v, upcast=False, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32, (lse.shape, lse.dtype)
    # bf16 rounding inside tanh in PyTorch makes its error irregular: FlashAttention uses 3 here.
    rule_k = 3.0 if kwargs.get("softcap") else 2.0
    assert_close_fa_rule(out, out_ref, out_pt, k=rule_k, name=name)
    assert_lse_close(lse, lse_ref, name=f"lse of {name}")
    return Checked(out, lse, out_ref, out_pt, rule_k)


def check_fwd(q, k, v, name="out", pack_gqa=None, **kwargs) -> Checked:
    out, lse = call_poisoned(flashgen.flash_attn_func, q, k, v, pack_gqa=pack_gqa, **kwargs)
    return check_against_ref(out, lse, q, k, v, name=name, **kwargs)


def assert_feature_matters(q, k, v, checked: Checked, **kwargs_without_feature) -> None:
    """The reference without the feature must fail the rule; otherwise a kernel that ignored the
    feature would pass the test."""
    out_without, _ = attention_ref(q, k, v, **kwargs_without_feature)
    with pytest.raises(AssertionError):
        assert_close_fa_rule(out_without, checked.out_ref, checked.out_pt, k=checked.rule_k)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd_dtype_dim_mask(dtype, head_dim, mask):
    q, k, v = make_qkv(2, 177, 255, 4, 4, head_dim, dtype)
    check_fwd(q, k, v, **MASKS[mask])


ODD_SEQLENS = [
    (1, 1), (1, 255), (17, 17), (17, 1023), (113, 113), (113, 128),
    (128, 113), (128, 128), (255, 1023), (1023, 255), (1023, 1023), (255, 1),
]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("seqlen_q, seqlen_k", seqlen_params(ODD_SEQLENS))
@pytest.mark.parametrize("head_dim", [64, 256], ids=lambda d: f"d{d}")
def test_fwd_odd_seqlens(head_dim, seqlen_q, seqlen_k, mask):
    # sq > sk with causal or local leaves the first rows with no visible key.
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 4, head_dim)
    check_fwd(q, k, v, **MASKS[mask])


@pytest.mark.parametrize("seqlen_q, seqlen_k", seqlen_params([(128, 128), (255, 1023), (1023, 255)]))
@pytest.mark.parametrize("window_size", [(33, 7), (0, 0), (-1, 16), (64, -1)], ids=lambda w: f"win{w[0]}_{w[1]}")
def test_fwd_local_windows(window_size, seqlen_q, seqlen_k):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 4, 64)
    check_fwd(q, k, v, window_size=window_size)


@pytest.mark.parametrize("seqlen_q, seqlen_k", seqlen_params([(113, 300), (300, 113)]))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("nheads_k", [2, 1], ids=["gqa8_2", "mqa8_1"])
@pytest.mark.parametrize("dtype, head_dim", dtype_dim_params(DTYPE_DIMS_A))
def test_fwd_gqa_pack_gqa(dtype, head_dim, nheads_k, mask, seqlen_q, seqlen_k):
    """PackGQA on, off or left to the heuristic: each meets the rule, and lse agrees between them."""
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 8, nheads_k, head_dim, dtype)
    lse = {
        pack_gqa: check_fwd(q, k, v, name=f"out(pack_gqa={pack_gqa})", pack_gqa=pack_gqa, **MASKS[mask]).lse
        for pack_gqa in (None, False, True)
    }
    assert_lse_close(lse[True], lse[False], name="lse(pack_gqa=True) vs lse(pack_gqa=False)")


# (softcap, softmax_scale * sqrt(d)): scores large enough that the cap changes the output by many
# times the rule's tolerance (checked by assert_feature_matters).  Near a cap of 30 bf16 scores are
# coarse and the tolerance loose, so the cap-5 case is the sharp one.
SOFTCAPS = [pytest.param(30.0, 30.0, id="cap30-scale30"), pytest.param(5.0, 2.0, id="cap5-scale2")]


@pytest.mark.parametrize("softcap, scale_factor", SOFTCAPS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype, head_dim", dtype_dim_params(DTYPE_DIMS_B))
def test_fwd_softcap(dtype, head_dim, mask, softcap, scale_factor):
    q, k, v = make_qkv(2, 177, 255, 4, 4, head_dim, dtype)
    kwargs = dict(softmax_scale=scale_factor / math.sqrt(head_dim), **MASKS[mask])
    checked = check_fwd(q, k, v, softcap=softcap, **kwargs)
    assert_feature_matters(q, k, v, checked, **kwargs)


def alibi_slopes(shape: str, batch: int, nheads: int) -> torch.Tensor:
    if shape == "h":
        return generate_alibi_slopes(nheads, device=DEVICE)
    return torch.rand(batch, nheads, device=DEVICE) * 0.3 + 0.01  # a different slope per batch too


@pytest.mark.parametrize("seqlen_q, seqlen_k", seqlen_params([(113, 300), (300, 113)]))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("slopes_shape", ["h", "bh"], ids=["slopes_h", "slopes_bh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd_alibi(dtype, slopes_shape, mask, seqlen_q, seqlen_k):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 4, 128, dtype)
    checked = check_fwd(q, k, v, alibi_slopes=alibi_slopes(slopes_shape, 2, 4), **MASKS[mask])
    assert_feature_matters(q, k, v, checked, **MASKS[mask])


@pytest.mark.parametrize("slopes_shape", ["h", "bh"], ids=["slopes_h", "slopes_bh"])
@pytest.mark.parametrize("pack_gqa", [False, True], ids=["nopack", "packgqa"])
def test_fwd_gqa_softcap_alibi(pack_gqa, slopes_shape):
    """Softcap before ALiBi, and each query head's own slope, also when heads are packed."""
    q, k, v = make_qkv(2, 300, 255, 8, 2, 128)
    kwargs = dict(causal=True, softmax_scale=2.0 / math.sqrt(128))
    slopes = alibi_slopes(slopes_shape, 2, 8)
    checked = check_fwd(q, k, v, pack_gqa=pack_gqa, softcap=5.0, alibi_slopes=slopes, **kwargs)
    assert_feature_matters(q, k, v, checked, softcap=5.0, **kwargs)
    assert_feature_matters(q, k, v, checked, alibi_slopes=slopes, **kwargs)


@pytest.mark.parametrize("softmax_scale", [0.03, 0.4])
def test_fwd_softmax_scale(softmax_scale):
    q, k, v = make_qkv(2, 177, 255, 4, 4, 64)
    checked = check_fwd(q, k, v, causal=True, softmax_scale=softmax_scale)
    assert_feature_matters(q, k, v, checked, causal=True)


@pytest.mark.parametrize("nheads_k, mask", [(4, "none"), (2, "causal"), (1, "local")], ids=["mha", "gqa-causal", "mqa-local"])
def test_fwd_noncontiguous(nheads_k, mask):
    batch, seqlen_q, seqlen_k, nheads, head_dim = 2, 113, 255, 4, 128
    # Strides stay multiples of 8 elements (16 bytes); only the last dim is contiguous.
    q = randn(batch, seqlen_q + 6, nheads, head_dim + 8)[:, 3 : 3 + seqlen_q, :, :head_dim]
    k = randn(batch, nheads_k, seqlen_k + 5, head_dim).transpose(1, 2)[:, 2 : 2 + seqlen_k]
    v = randn(batch, seqlen_k, nheads_k, 2 * head_dim)[..., head_dim:]
    assert not any(x.is_contiguous() for x in (q, k, v))
    originals = [x.clone() for x in (q, k, v)]
    check_fwd(q, k, v, **MASKS[mask])
    assert all(torch.equal(x, orig) for x, orig in zip((q, k, v), originals)), "inputs were modified"


def test_fwd_contiguous_views_off_a_16_byte_boundary():
    """Contiguous q, k, v that start one element past a chunk boundary (views into a larger
    buffer): the kernels read 16-byte chunks, so the call runs on aligned copies, also after the
    same description's aligned call left a launch record."""
    shape_q, shape_kv = (2, 113, 4, 128), (2, 255, 2, 128)
    aligned = make_qkv(2, 113, 255, 4, 2, 128)
    check_fwd(*aligned, causal=True)  # leaves the description's launch record
    views = []
    for shape in (shape_q, shape_kv, shape_kv):
        storage = randn(math.prod(shape) + 1)
        views.append(storage[1:].view(shape))
    assert all(x.is_contiguous() and x.data_ptr() % 16 for x in views)
    check_fwd(*views, causal=True)


@pytest.mark.parametrize("head_dim, nheads_k, mask", [(128, 2, "causal"), (64, 4, "none"), (256, 1, "local")])
def test_fwd_repeated_calls_read_each_calls_tensors(head_dim, nheads_k, mask):
    """A repeated call of one description launches from its record with the new call's pointers
    and tensor maps: fresh inputs each time, and the first ones again."""
    first = make_qkv(2, 300, 255, 4, nheads_k, head_dim)
    for qkv in (first, make_qkv(2, 300, 255, 4, nheads_k, head_dim), make_qkv(2, 300, 255, 4, nheads_k, head_dim), first):
        check_fwd(*qkv, **MASKS[mask])


@pytest.mark.parametrize("mask", MASKS)
def test_fwd_qkvpacked(mask):
    qkv = randn(2, 255, 3, 4, 64)
    out, lse = call_poisoned(flashgen.flash_attn_qkvpacked_func, qkv, **MASKS[mask])
    check_against_ref(out, lse, *qkv.unbind(2), **MASKS[mask])


@pytest.mark.parametrize("mask", MASKS)
def test_fwd_kvpacked(mask):
    q, kv = randn(2, 300, 8, 64), randn(2, 113, 2, 2, 64)
    out, lse = call_poisoned(flashgen.flash_attn_kvpacked_func, q, kv, **MASKS[mask])
    check_against_ref(out, lse, q, *kv.unbind(2), **MASKS[mask])


@pytest.mark.parametrize("causal", [False, True], ids=["nocausal", "causal"])
def test_fwd_seqlen_k_zero(causal):
    q, k, v = make_qkv(2, 17, 0, 4, 4, 64)
    out, lse = call_poisoned(flashgen.flash_attn_func, q, k, v, causal=causal)
    assert out.shape == q.shape and (out == 0).all()
    assert lse.shape == (2, 4, 17) and torch.isneginf(lse).all()


def test_return_attn_probs():
    q, k, v = make_qkv(2, 113, 255, 4, 4, 64)
    out = flashgen.flash_attn_func(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor)
    result = flashgen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 3 and result[2] is None
    assert torch.equal(result[0], out)


def test_dropout_refused_in_graph_capture():
    q, k, v = make_qkv(1, 17, 17, 4, 4, 64)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(NotImplementedError, match="dropout_p"):
        with torch.cuda.graph(graph):
            flashgen.flash_attn_func(q, k, v, dropout_p=0.1)


def test_cuda_graph_replay():
    q, k, v = make_qkv(2, 300, 255, 8, 2, 128)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # Warm up outside the capture: compiling and loading the module synchronizes, which capture forbids.
        for _ in range(2):
            flashgen.flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = flashgen.flash_attn_func(q, k, v, causal=True)
    for _ in range(2):  # replays must read the new inputs, not values baked in at capture
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        out_static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_static, flashgen.flash_attn_func(q, k, v, causal=True))
        out_ref, _ = attention_ref(q, k, v, causal=True)
        out_pt, _ = attention_ref(q, k, v, causal=True, upcast=False)
        assert_close_fa_rule(out_static, out_ref, out_pt)


def test_a_new_thread_launches_without_a_cuda_call_of_its_own():
    """A thread that has made no CUDA runtime call (its output served from the allocator's cache)
    has no context current: flashgen's first launch there binds PyTorch's primary context."""
    import threading

    q, k, v = make_qkv(2, 300, 255, 8, 2, 128)
    expected = flashgen.flash_attn_func(q, k, v, causal=True)  # compiled, loaded, its blocks cached
    del expected
    result = {}

    def work():
        try:
            result["out"] = flashgen.flash_attn_func(q, k, v, causal=True)
        except Exception as error:  # reported below, in the test's thread
            result["error"] = error

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert "error" not in result, result.get("error")
    torch.cuda.synchronize()
    out_ref, _ = attention_ref(q, k, v, causal=True)
    out_pt, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert_close_fa_rule(result["out"], out_ref, out_pt)


def test_non_default_stream():
    q, k, v = make_qkv(2, 300, 255, 8, 2, 128)
    flashgen.flash_attn_func(q, k, v, causal=True)  # compile and load first: both may synchronize
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        poison_allocator()  # before the sleep: empty_cache synchronizes the device
        # Inputs are written only after a long sleep on `stream`: a kernel launched on any other
        # stream (the legacy default one included: PyTorch's streams do not sync with it) would
        # read NaN instead.
        torch.cuda._sleep(50_000_000)
        q, k, v = make_qkv(2, 300, 255, 8, 2, 128)
        out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    torch.cuda.synchronize()
    check_against_ref(out, lse, q, k, v, causal=True)
