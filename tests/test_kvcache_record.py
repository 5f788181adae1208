"""CPU tier: a repeated flash_attn_with_kvcache call takes the launch record its first call left
(execute.LaunchRecord, in kvcache._kvcache_records) and launches exactly what the full path launches
for its tensors: the append, the forward and the split-KV combine, in order, with the same
kernels, grids, shared memory, threads, flags and params bytes, the pointers being the call's.
No GPU: the device, tensor maps and launches are stand-ins, and the tensors live on the CPU.

Launches are compared with every pointer their params hold replaced by a name: the call's
tensors (arguments, outputs, split-KV partials) by theirs, the first call's by "first:" names
(a stale pointer), and what else the call allocated (a rotated q, cache_seqlens made from an
int, converted rotary tables) by order of appearance."""
from __future__ import annotations

import contextlib

import dataclasses
import struct
import typing

import pytest
import torch

import flashgen
from flashgen.generator import params as params_mod
from flashgen.runtime import execute, interface, kvcache, tuning, validate
from flashgen.runtime.device import DeviceInfo
from launch_capture import AMPERE, HOPPER, LAYOUTS, POINTER, Launched, stand_in_device, symbolic


class Device:
    """What the stand-in device saw: launches, record hits, split-KV partials allocated."""

    def __init__(self) -> None:
        self.launches: list[Launched] = []
        self.hits = 0
        self.partials: list[tuple] = []  # kept alive: no address is reused within a test


@pytest.fixture
def device(monkeypatch, request):
    seen = Device()
    info = getattr(request, "param", HOPPER)
    stand_in_device(monkeypatch, info, (kvcache, interface, execute), seen.launches)
    monkeypatch.setattr(kvcache, "_kvcache_records", execute.LaunchRecords())
    monkeypatch.setattr(interface, "_fwd_records", execute.LaunchRecords())
    replay, split = execute.run_record, execute.split_partials

    def counted(*args):
        seen.hits += 1
        return replay(*args)

    def kept(*args):
        seen.partials.append(split(*args))
        return seen.partials[-1]

    monkeypatch.setattr(execute, "run_record", counted)
    monkeypatch.setattr(interface, "run_record", counted)
    monkeypatch.setattr(execute, "split_partials", kept)
    return seen


@dataclasses.dataclass(frozen=True)
class Case:
    """The tensors of a flash_attn_with_kvcache call."""

    batch: int = 1
    seqlen_q: int = 1
    nheads: int = 32
    nheads_k: int = 8
    head_dim: int = 128
    capacity: int = 4096
    seqlen_new: int = 0
    rotary_dim: int = 0
    rotary_dtype: torch.dtype = torch.float32
    page_size: int = 0  # 0: a contiguous cache
    cache_rows: int = 0  # rows of a contiguous cache past the batch: cache_batch_idx picks them
    leftpad: bool = False
    alibi: bool = False
    seqlens: str = "tensor"  # or "int", "none"
    dtype: torch.dtype = torch.bfloat16

    def tensors(self) -> dict:
        b, hk, d = self.batch, self.nheads_k, self.head_dim
        lengths = [self.capacity - self.seqlen_new - 7 * i for i in range(b)]
        if self.page_size:
            pages = b * self.capacity // self.page_size
            cache_shape = (pages, self.page_size, hk, d)
            block_table = torch.randperm(pages, dtype=torch.int32).view(b, -1)
        else:
            cache_shape = (b + self.cache_rows, self.capacity, hk, d)
            block_table = None
        seqlens = {"tensor": torch.tensor(lengths, dtype=torch.int32), "int": lengths[0], "none": None}
        x = dict(
            q=torch.randn(b, self.seqlen_q, self.nheads, d, dtype=self.dtype),
            k_cache=torch.empty(cache_shape, dtype=self.dtype), v_cache=torch.empty(cache_shape, dtype=self.dtype),
            block_table=block_table, cache_seqlens=seqlens[self.seqlens],
        )
        if self.seqlen_new:
            x.update(k=torch.randn(b, self.seqlen_new, hk, d, dtype=self.dtype),
                     v=torch.randn(b, self.seqlen_new, hk, d, dtype=self.dtype))
        if self.rotary_dim:
            x.update(rotary_cos=torch.rand(self.capacity, self.rotary_dim // 2, dtype=self.rotary_dtype),
                     rotary_sin=torch.rand(self.capacity, self.rotary_dim // 2, dtype=self.rotary_dtype))
        if self.cache_rows:
            x.update(cache_batch_idx=torch.randperm(b + self.cache_rows, dtype=torch.int32)[:b])
        if self.leftpad:
            x.update(cache_leftpad=torch.tensor([3 * i for i in range(b)], dtype=torch.int32))
        if self.alibi:
            x.update(alibi_slopes=torch.rand(self.nheads, dtype=torch.float32))
        return x


def decode(x: dict, return_softmax_lse=True, **options):
    """flash_attn_with_kvcache on the tensors ``x``: (out, lse), lse None unless returned."""
    result = flashgen.flash_attn_with_kvcache(**x, return_softmax_lse=return_softmax_lse, **options)
    return result if return_softmax_lse else (result, None)


def names(x: dict, out, lse, partials, prefix: str = "") -> dict:
    """address -> name of a call's tensors."""
    named = {t.data_ptr(): prefix + name for name, t in x.items() if isinstance(t, torch.Tensor)}
    named.update({t.data_ptr(): prefix + name for name, t in (("out", out), ("lse", lse)) if t is not None})
    for pair in partials:
        named.update({t.data_ptr(): prefix + name for name, t in zip(("oaccum", "lseaccum"), pair)})
    return named


class Call(typing.NamedTuple):
    launches: list[Launched]
    named: dict  # the call's tensors by address (the first call's as "first:...")
    hit: bool


def run(device: Device, x: dict, first: dict | None = None, records: bool = True, **options) -> Call:
    """One call on ``x``, what it launched and whether it took a record; ``records=False``: the
    full path (no record read or written)."""
    start, hits, partials = len(device.launches), device.hits, len(device.partials)
    with contextlib.nullcontext() if records else kvcache._kvcache_records.off():
        out, lse = decode(x, **options)
        if not records:
            assert kvcache._kvcache_records == {}, "records off: none written"
    named = names(first, None, None, (), "first:") if first is not None else {}
    named.update(names(x, out, lse, device.partials[partials:]))
    return Call(device.launches[start:], named, device.hits > hits)


def assert_record_matches_full_path(device: Device, x: dict, first: dict, **options) -> list[tuple]:
    recorded = run(device, x, first, **options)
    assert recorded.hit, "the call takes the record"
    full = run(device, x, first, records=False, **options)
    assert not full.hit
    mine, expected = symbolic(recorded.launches, recorded.named), symbolic(full.launches, full.named)
    assert mine == expected
    return expected


CASES = {  # (Case's default: 32 query heads over 8 KV heads)
    "plain": (Case(), dict(num_splits=0)),
    "append": (Case(seqlen_new=1), dict(num_splits=0)),
    "rotary-append-causal": (Case(batch=2, seqlen_q=2, seqlen_new=2, rotary_dim=64, capacity=1024),
                             dict(causal=True, rotary_interleaved=False)),
    "rotary-q-only": (Case(rotary_dim=128, capacity=512), dict(rotary_interleaved=True)),
    "rotary-fp16-tables": (Case(seqlen_new=1, rotary_dim=32, rotary_dtype=torch.float16, capacity=512), {}),
    "paged": (Case(batch=2, page_size=256, seqlen_new=1), dict(num_splits=0)),
    "paged-small-pages": (Case(batch=3, page_size=16, capacity=512, seqlen_new=3, seqlen_q=3), dict(causal=True)),
    "cache-batch-idx": (Case(batch=2, cache_rows=3, seqlen_new=1, capacity=1024), {}),
    "leftpad": (Case(batch=2, leftpad=True, capacity=1024), dict(causal=True)),
    "pack-gqa": (Case(capacity=2048), dict(pack_gqa=True)),
    "no-pack-gqa": (Case(capacity=2048), dict(pack_gqa=False)),
    "local": (Case(batch=2, seqlen_q=4, capacity=1024), dict(window_size=(100, 0))),
    "local-two-sided": (Case(capacity=1024, nheads=8, nheads_k=8), dict(window_size=(64, 16))),
    "softcap": (Case(capacity=1024), dict(softcap=30.0, softmax_scale=0.1)),
    "alibi": (Case(batch=2, alibi=True, capacity=1024), {}),
    "split-combine": (Case(capacity=8192), dict(num_splits=16)),
    "split-combine-append": (Case(batch=2, seqlen_new=1, capacity=8192), dict(num_splits=12)),
    "split-two": (Case(capacity=4096, head_dim=64), dict(num_splits=2)),
    "no-lse": (Case(seqlen_new=1), dict(return_softmax_lse=False)),
    "seqlens-int": (Case(seqlens="int", seqlen_new=1, capacity=1024), {}),
    "seqlens-none": (Case(seqlens="none", capacity=1024), {}),
    "paired-kv-heads": (Case(batch=20, head_dim=64, capacity=2048), {}),
    "short-cache": (Case(capacity=128, seqlen_new=1), {}),
    "prefill-rows": (Case(batch=2, seqlen_q=128, nheads=8, nheads_k=8, capacity=1024), dict(causal=True)),
    "prefill-rows-paged": (Case(batch=2, seqlen_q=128, nheads=8, nheads_k=2, capacity=1024, page_size=128,
                                seqlen_new=128, rotary_dim=64), dict(causal=True)),
    "fp16": (Case(dtype=torch.float16, head_dim=256, nheads=4, nheads_k=4, capacity=512), {}),
}


@pytest.mark.parametrize("device", [HOPPER, AMPERE], indirect=True, ids=["sm90", "sm80"])
@pytest.mark.parametrize("name", CASES)
def test_a_repeated_call_launches_what_the_full_path_does(device, name):
    case, options = CASES[name]
    first = case.tensors()
    made = run(device, first, **options)
    assert not made.hit and len(kvcache._kvcache_records) == 1, "the first call records its launches"
    for x in (case.tensors(), first):  # fresh tensors of the description, then the first call's again
        launched = assert_record_matches_full_path(device, x, first, **options)
        if x is not first:
            assert not any(p.startswith("first:") for *_, pointers, _ in launched for p in pointers)


def kinds(device_info: DeviceInfo, name: str, monkeypatch) -> list[str]:
    """What a case launches on a device: kernel directions, with "cluster" for a merge in clusters
    and "sm90" for the sm90 forward."""
    case, options = CASES[name]
    seen = Device()
    monkeypatch.setattr(kvcache, "_kvcache_records", execute.LaunchRecords())  # (a record is of one device, whose info is fixed)
    monkeypatch.setattr(kvcache, "device_info", lambda index: device_info)
    monkeypatch.setattr(execute, "device_info", lambda index: device_info)
    monkeypatch.setattr(execute, "launch_kernel", lambda spec, *args, cluster=None, **kw: seen.launches.append(
        (spec.direction, spec.family, cluster)))
    decode(case.tensors(), **options)
    return [d + ("-sm90" if family == "sm90" and d == "fwd" else "") + ("-cluster" if cluster else "")
            for d, family, cluster in seen.launches]


@pytest.mark.parametrize("name, sm90, sm80", [
    ("plain", ["fwd-cluster"], ["fwd", "combine"]),
    ("append", ["append", "fwd-cluster"], ["append", "fwd", "combine"]),
    ("split-combine", ["fwd", "combine"], ["fwd", "combine"]),
    ("split-two", ["fwd-cluster"], ["fwd", "combine"]),
    ("prefill-rows", ["fwd-sm90", "combine"], ["fwd", "combine"]),
    ("prefill-rows-paged", ["append", "fwd-sm90", "combine"], ["append", "fwd", "combine"]),
    ("rotary-q-only", ["append", "fwd"], ["append", "fwd"]),
])
def test_the_matrix_covers_what_each_device_launches(device, monkeypatch, name, sm90, sm80):
    """The cases above launch these on each device (the plan differs): split-KV through the
    combine and merged in clusters, the append, the sm90 forward with its tensor maps."""
    assert kinds(HOPPER, name, monkeypatch) == sm90
    assert kinds(AMPERE, name, monkeypatch) == sm80


def test_a_wrong_pointer_would_be_caught(device):
    """The comparison sees a stale pointer: a record that failed to patch one launches the
    first call's tensor there."""
    case, options = CASES["split-combine-append"]
    first = case.tensors()
    run(device, first, **options)
    (key, record), = kvcache._kvcache_records.items()
    append, fwd, combine = record.launches
    kvcache._kvcache_records[key] = record._replace(launches=(append, fwd._replace(pointers=fwd.pointers[1:]), combine))
    x = case.tensors()
    with pytest.raises(AssertionError, match="first:"):
        assert_record_matches_full_path(device, x, first, **options)


@pytest.mark.parametrize("device", [HOPPER, AMPERE], indirect=True, ids=["sm90", "sm80"])
def test_records_patch_every_pointer_they_hold(device):
    """Each recorded launch writes a call's pointer into every pointer field its params hold (a
    field left as the recording call packed it would point to that call's tensor)."""
    for name, (case, options) in CASES.items():
        decode(case.tensors(), **options)
    # One record a case, but for no-lse: return_softmax_lse changes no launch (append's serves it).
    assert len(kvcache._kvcache_records) == len(CASES) - 1
    for record in kvcache._kvcache_records.values():
        for launch in record.launches:
            layout = LAYOUTS[launch.spec.direction]
            held = {offset for field, offset in zip(layout.fields, layout.offsets)
                    if field.kind == "ptr" and POINTER.unpack_from(launch.params, offset)[0]}
            assert {offset for offset, _ in launch.pointers} == held
            assert (launch.maps is not None) == (launch.spec.family == "sm90" and launch.spec.direction == "fwd")


def test_cache_seqlens_as_an_int_is_data(device, monkeypatch):
    """cache_seqlens given as an int: the record makes the tensor per call from the call's value
    (which the value checks see), none is baked in."""
    monkeypatch.setenv("FLASHGEN_CHECK_INPUTS", "1")
    checked = []
    check = validate.kvcache_values
    monkeypatch.setattr(validate, "kvcache_values",
                        lambda seqlens, *args: (checked.append(seqlens), check(seqlens, *args)))
    case = Case(seqlens="int", seqlen_new=1, capacity=1024, batch=2)
    x = case.tensors()
    for length in (100, 101, 700):
        x["cache_seqlens"] = length
        call = run(device, x)
        assert call.hit == (length != 100)
        assert checked[-1].tolist() == [length, length]
        fwd = next(launch for launch in call.launches if launch.spec.direction == "fwd")
        offset = params_mod.FWD_LAYOUT.offsets[[f.name for f in params_mod.FWD_LAYOUT.fields].index("seqused_k_ptr")]
        assert POINTER.unpack_from(fwd.params, offset)[0] == checked[-1].data_ptr()
    x["cache_seqlens"] = 1024  # past the capacity with the appended row: validate.kvcache still refuses
    with pytest.raises(ValueError, match="cache_seqlens"):
        decode(x)


def test_value_checks_run_on_every_call(device, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CHECK_INPUTS", "1")
    case = Case(batch=2, page_size=16, capacity=256, seqlen_new=1)
    x = case.tensors()
    run(device, x)
    assert run(device, case.tensors()).hit
    x["cache_seqlens"] = torch.tensor([255, 300], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens"):
        decode(x)
    x["cache_seqlens"] = torch.tensor([3, 4], dtype=torch.int32)
    x["block_table"] = x["block_table"].clone()
    x["block_table"][1, 0] = 10_000
    with pytest.raises(ValueError, match="block_table"):
        decode(x)
    assert device.hits == 1 and run(device, case.tensors()).hit  # refused before any launch, record kept


@pytest.mark.parametrize("change, error", [
    (lambda x: dict(causal=1), TypeError),
    (lambda x: dict(rotary_interleaved="False"), TypeError),
    (lambda x: dict(num_splits=-1), ValueError),
    (lambda x: dict(softcap=-1.0), ValueError),
    (lambda x: dict(cache_seqlens=x["cache_seqlens"].long()), TypeError),
    (lambda x: dict(cache_seqlens=1024), ValueError),
    (lambda x: dict(k=x["k"].float()), TypeError),
    (lambda x: dict(v=None), ValueError),
])
def test_bad_arguments_raise_with_a_record_in_place(device, change, error):
    case = Case(batch=2, seqlen_new=1, capacity=1024)
    run(device, case.tensors())
    assert run(device, case.tensors()).hit
    x = case.tensors()
    x.update(change(x))
    with pytest.raises(error):
        decode(x)


def test_a_call_of_another_description_takes_no_record(device, monkeypatch):
    case = Case(batch=2, seqlen_new=1, capacity=1024)
    x = case.tensors()
    run(device, x)
    records = 1

    def another(y: dict, **options) -> None:
        nonlocal records
        call = run(device, y, **options)
        assert not call.hit
        records += 1
        assert len(kvcache._kvcache_records) == records
        assert run(device, y, **options).hit  # and leaves its own

    heads_first = torch.empty(3, 8, 1024, 128, dtype=torch.bfloat16).transpose(1, 2)
    another({**x, "k_cache": heads_first[:2], "v_cache": heads_first[1:]})  # other strides
    another({**x, "k_cache": torch.empty(3, 1024, 8, 128, dtype=torch.bfloat16),
             "v_cache": torch.empty(3, 1024, 8, 128, dtype=torch.bfloat16)})  # another cache shape
    another({name: t.half() if name in ("q", "k_cache", "v_cache", "k", "v") else t for name, t in x.items()})
    another({**x, "cache_seqlens": 50})  # an int rather than a tensor
    another({**x, "k": x["k"][:, :0], "v": x["v"][:, :0]})  # no row appended
    another({**x, "q": torch.randn(2, 1, 64, 128, dtype=torch.bfloat16)[:, :, :32]})  # q's batch stride
    another(x, causal=True)
    another(x, softmax_scale=0.5)
    another(x, num_splits=3)
    another(x, pack_gqa=False)
    another({**x, "cache_leftpad": torch.zeros(2, dtype=torch.int32)})
    with tuning.use(merge_in_cluster=False):
        another(x)
    monkeypatch.setenv("FLASHGEN_FAMILY", "sm80")
    another(x)
    monkeypatch.setenv("FLASHGEN_CHECK_INPUTS", "1")
    another(x)


def test_copies_and_misaligned_inputs_take_the_full_path(device):
    case = Case(batch=2, seqlen_new=1, capacity=1024, rotary_dim=64)
    x = case.tensors()
    base = torch.empty(x["q"].numel() + 4, dtype=torch.bfloat16)
    misaligned_q = base[4:].view(x["q"].shape)  # 8 bytes off a 16-byte boundary
    call = run(device, {**x, "q": misaligned_q})
    assert not call.hit and kvcache._kvcache_records == {}, "a misaligned q: no record"
    run(device, x)
    assert len(kvcache._kvcache_records) == 1
    for changed in ("q", "k_cache", "v_cache"):
        t = x[changed]
        base = torch.empty(t.numel() + 8, dtype=t.dtype)
        view = base[1:1 + t.numel()].view(t.shape)  # 2 bytes off
        call = run(device, {**x, changed: view})
        assert not call.hit, f"a misaligned {changed}: the full path"
        if changed != "q":  # q is rotated into an allocation of the call; the caches are copied
            fwd = next(launch for launch in call.launches if launch.spec.direction == "fwd")
            assert struct.pack("<Q", view.data_ptr()) not in fwd.params
    odd = torch.empty(2, 1024, 8, 130, dtype=torch.bfloat16)[..., :128]  # rows of 130: aligned, not whole chunks
    call = run(device, {**x, "k_cache": odd, "v_cache": odd.clone()})
    assert not call.hit and not run(device, {**x, "k_cache": odd, "v_cache": odd.clone()}).hit, "copied: never recorded"


def test_one_tensor_passed_as_two_arguments_is_not_recorded(device):
    case = Case(batch=2, seqlen_new=1, capacity=1024)
    x = case.tensors()
    run(device, {**x, "v_cache": x["k_cache"]})
    assert kvcache._kvcache_records == {}  # which of the two a later call's pointer is would be a guess
    run(device, x)
    assert_record_matches_full_path(device, {**case.tensors(), "v_cache": x["k_cache"]}, x)  # a hit is fine


def test_a_block_table_copied_per_call(device):
    """A block table of non-unit column stride is made contiguous per call on both paths."""
    case = Case(batch=2, page_size=16, capacity=256, seqlen_new=1)
    x = case.tensors()
    x["block_table"] = x["block_table"].t().contiguous().t()
    run(device, x)
    y = case.tensors()
    y["block_table"] = y["block_table"].t().contiguous().t()
    launched = assert_record_matches_full_path(device, y, x)
    assert "block_table" not in str(launched)  # a copy of it: a new allocation


@pytest.mark.parametrize("head_dim", [59, 100])
def test_padded_head_dims(device, head_dim):
    """Head dims off a multiple of 8 run on padded copies, made per call on both paths."""
    case = Case(batch=2, seqlen_new=1, capacity=256, head_dim=head_dim, nheads=4, nheads_k=2, rotary_dim=32)
    first = case.tensors()
    run(device, first)
    assert_record_matches_full_path(device, case.tensors(), first)


def test_the_record_cache_is_bounded(device, monkeypatch):
    monkeypatch.setattr(kvcache._kvcache_records, "capacity", 2)
    for capacity in (256, 512, 1024):
        run(device, Case(capacity=capacity).tensors())
    assert len(kvcache._kvcache_records) == 1  # cleared when full
    monkeypatch.setattr(kvcache._kvcache_records, "capacity", 0)
    x = Case(capacity=128).tensors()
    run(device, x)
    assert not run(device, x).hit and len(kvcache._kvcache_records) == 1


@pytest.mark.parametrize("device", [HOPPER, AMPERE], indirect=True, ids=["sm90", "sm80"])
@pytest.mark.parametrize("num_splits, shape", [(4, (1, 1, 2048, 16, 4, 128)), (3, (2, 64, 1000, 8, 8, 64)),
                                               (16, (1, 1, 4096, 8, 8, 128)), (1, (2, 128, 128, 4, 4, 64))])
def test_dense_forwards_record_through_the_same_launches(device, monkeypatch, num_splits, shape):
    """flash_attn_func's record is the same LaunchRecord: split-KV with its partials and combine too."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim = shape

    def forward(q, k, v):
        return interface._fwd(q, k, v, head_dim ** -0.5, False, (-1, -1), 0.0, None, None, num_splits)[:2]

    def qkv():
        return (torch.randn(batch, seqlen_q, nheads, head_dim, dtype=torch.bfloat16),
                torch.randn(batch, seqlen_k, nheads_k, head_dim, dtype=torch.bfloat16),
                torch.randn(batch, seqlen_k, nheads_k, head_dim, dtype=torch.bfloat16))

    def launched(q, k, v, records: bool):
        """What a forward on q, k, v launches, named, and whether it took a record; records=False:
        the full path (no record read or written)."""
        start, partials, hits = len(device.launches), len(device.partials), device.hits
        with contextlib.nullcontext() if records else interface._fwd_records.off():
            out, lse = forward(q, k, v)
            if not records:
                assert interface._fwd_records == {}
        named = names(dict(q=q, k=k, v=v), out, lse, device.partials[partials:])
        return symbolic(device.launches[start:], named), device.hits > hits

    assert launched(*qkv(), records=True)[1] is False
    assert len(interface._fwd_records) == 1
    x = qkv()
    mine, hit = launched(*x, records=True)
    assert hit and mine == launched(*x, records=False)[0]
    if num_splits > 1:
        assert any("oaccum" in pointers for *_, pointers, _ in mine) == (mine[-1][0].startswith("flash_combine"))
    # One tensor for q, k and v (self-attention on one buffer): recorded apart, read from its one slot.
    if seqlen_q == seqlen_k and nheads == nheads_k:
        y = torch.randn(batch, seqlen_q, nheads, head_dim, dtype=torch.bfloat16)
        assert not launched(y, y, y, records=True)[1]
        assert len(interface._fwd_records) == 2
        z = torch.randn_like(y)
        mine, hit = launched(z, z, z, records=True)
        assert hit and mine == launched(z, z, z, records=False)[0]
        mine, hit = launched(*qkv(), records=True)  # three tensors again: the first record
        assert hit and mine[0][6][:3] == ("q", "k", "v")
