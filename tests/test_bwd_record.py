"""CPU tier: a repeated backward takes the launch record its first call left (execute.LaunchRecord,
in backward._bwd_records) and launches exactly what the full path launches for its tensors: the
preprocess, the main kernel (the sm90 one with its TMA maps, made from the call's tensors) and the
postprocess, with the same kernels, grids, shared memory, threads and params bytes, the pointers
being the call's, and buffers of the same shapes allocated per call. No GPU: the device, tensor
maps and launches are stand-ins, and the tensors live on the CPU.

Launches are compared as in test_kvcache_record.py: every pointer their params (and stand-in maps)
hold replaced by a name: the call's tensors by theirs, its per-call buffers by theirs, the first
call's tensors by "first:" names (a stale pointer), and what else the call allocated (a copy) by
order of appearance."""
from __future__ import annotations

import contextlib
import dataclasses
import struct
import typing

import pytest
import torch

import flashgen
from flashgen.generator import params as params_mod
from flashgen.runtime import backward, execute, interface, tma, tuning
from launch_capture import AMPERE, HOPPER, LAYOUTS, POINTER, SM90_MAPS, Launched, stand_in_device, symbolic

BUFFERS = ("dsum", "lse_log2", "dq_accum", "semaphores")  # backward.bwd_buffers' order


class Device:
    """What the stand-in device saw: launches, record hits, plans and packs, per-call buffers."""

    def __init__(self) -> None:
        self.launches: list[Launched] = []
        self.hits = 0
        self.plans = 0
        self.packs = 0
        self.buffers: list[tuple] = []  # kept alive: no address is reused within a test


@pytest.fixture
def device(monkeypatch, request):
    seen = Device()
    info = getattr(request, "param", HOPPER)
    stand_in_device(monkeypatch, info, (backward, interface, execute), seen.launches)
    replay, plan, pack, buffers = execute.run_record, backward.plan_bwd, params_mod.pack, backward.bwd_buffers

    def counted_replay(*args):
        seen.hits += 1
        return replay(*args)

    def counted_plan(**kwargs):
        seen.plans += 1
        return plan(**kwargs)

    def counted_pack(*args):
        seen.packs += 1
        return pack(*args)

    def kept_buffers(*args):
        seen.buffers.append(buffers(*args))
        return seen.buffers[-1]

    monkeypatch.setattr(execute, "run_record", counted_replay)
    monkeypatch.setattr(backward, "plan_bwd", counted_plan)
    monkeypatch.setattr(params_mod, "pack", counted_pack)
    monkeypatch.setattr(backward, "bwd_buffers", kept_buffers)
    backward._bwd_records.clear()
    yield seen
    backward._bwd_records.clear()


@dataclasses.dataclass(frozen=True)
class Case:
    """The tensors of a backward call (flash_attn's or flash_attn_varlen's)."""

    batch: int = 2
    seqlen_q: int = 128
    seqlen_k: int = 128
    nheads: int = 4
    nheads_k: int = 4
    head_dim: int = 64
    dtype: torch.dtype = torch.bfloat16
    lengths: tuple[tuple[int, int], ...] = ()  # varlen: (query rows, key rows) of each sequence
    seqused: bool = False  # varlen: seqused_q and seqused_k, a few rows short of each sequence
    layout: str = "contiguous"  # or "packed" (q, k, v views of one qkv tensor), "heads-first" (bhsd memory)
    alibi: int = 0  # 0: none; 1: slopes (nheads,); 2: (batch, nheads)

    def _randn(self, rows: tuple, nheads: int) -> torch.Tensor:
        if self.layout == "heads-first" and len(rows) == 2:
            batch, seqlen = rows
            return torch.randn(batch, nheads, seqlen, self.head_dim, dtype=self.dtype).transpose(1, 2)
        return torch.randn(*rows, nheads, self.head_dim, dtype=self.dtype)

    def tensors(self) -> dict:
        varlen = bool(self.lengths)
        rows_q = (sum(n for n, _ in self.lengths),) if varlen else (self.batch, self.seqlen_q)
        rows_k = (sum(n for _, n in self.lengths),) if varlen else (self.batch, self.seqlen_k)
        if self.layout == "packed":  # self-attention's packed projection: q, k, v interleaved per row
            assert rows_q == rows_k and self.nheads == self.nheads_k
            qkv = torch.randn(*rows_q, 3, self.nheads, self.head_dim, dtype=self.dtype)
            q, k, v = qkv.unbind(-3)
        else:
            q = self._randn(rows_q, self.nheads)
            k, v = self._randn(rows_k, self.nheads_k), self._randn(rows_k, self.nheads_k)
        x = dict(dout=self._randn(rows_q, self.nheads), q=q, k=k, v=v, out=self._randn(rows_q, self.nheads))
        stats = (self.nheads, *rows_q) if varlen else (self.batch, self.nheads, self.seqlen_q)
        x.update(lse=torch.randn(stats, dtype=torch.float32), dq=torch.empty_like(q), dk=torch.empty_like(k),
                 dv=torch.empty_like(v))
        if self.alibi:
            x["alibi_slopes"] = torch.rand((self.batch, self.nheads)[2 - self.alibi:], dtype=torch.float32)
        if varlen:
            for name, column in (("q", 0), ("k", 1)):
                x[f"cu_seqlens_{name}"] = torch.tensor([0, *torch.tensor(self.lengths)[:, column].cumsum(0).tolist()],
                                                      dtype=torch.int32)
                if self.seqused:
                    x[f"seqused_{name}"] = torch.tensor([max(0, n - 3) for n in torch.tensor(self.lengths)[:, column]],
                                                        dtype=torch.int32)
        return x

    def max_seqlens(self) -> tuple[int, int]:
        return max(n for n, _ in self.lengths), max(n for _, n in self.lengths)


def bwd(case: Case, x: dict, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False, dropout_p=0.0,
        rng_state=None, softmax_scale=None) -> None:
    """The backward op's body on ``x`` (interface._bwd, or _varlen_bwd for a varlen case), as autograd calls it."""
    scale = case.head_dim ** -0.5 if softmax_scale is None else softmax_scale
    rng_state = torch.tensor([1234, 8], dtype=torch.int64) if rng_state is None else rng_state
    grads = [x[name] for name in ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")]
    options = (scale, causal, *window_size, softcap, x.get("alibi_slopes"))
    if case.lengths:
        interface._varlen_bwd(*grads, x["cu_seqlens_q"], x["cu_seqlens_k"], *case.max_seqlens(), *options,
                              x.get("seqused_q"), x.get("seqused_k"), dropout_p, rng_state, deterministic)
    else:
        interface._bwd(*grads, *options, dropout_p, rng_state, deterministic)


def names(x: dict, buffers, prefix: str = "") -> dict:
    """address -> name of a call's tensors and per-call buffers (the first name of an address:
    one tensor passed as q, k and v is "q")."""
    named: dict = {}
    for name, t in x.items():
        named.setdefault(t.data_ptr(), prefix + name)
    for made in buffers:
        for name, t in zip(BUFFERS, made):
            if t is not None:
                named.setdefault(t.data_ptr(), prefix + name)
    return named


def described(buffer: torch.Tensor | None):
    """A per-call buffer as two calls' must agree: shape, dtype and, for the semaphores (int32),
    that they start zeroed (the others hold whatever empty() gave)."""
    if buffer is None:
        return None
    return buffer.shape, buffer.dtype, buffer.dtype != torch.int32 or bool((buffer == 0).all())


class Call(typing.NamedTuple):
    launches: list[Launched]
    named: dict  # the call's tensors and buffers by address (the first call's as "first:...")
    buffers: list[tuple]  # (shape, dtype, all zero) of each per-call buffer
    hit: bool
    planned: bool
    packed: bool


def run(device: Device, case: Case, x: dict, first: dict | None = None, records: bool = True, **options) -> Call:
    """One backward on ``x``, what it launched and allocated, and whether it took a record;
    ``records=False``: the full path (no record read or written)."""
    start, hits, plans, packs, made = (len(device.launches), device.hits, device.plans, device.packs,
                                       len(device.buffers))
    with contextlib.nullcontext() if records else backward._bwd_records.off():
        bwd(case, x, **options)
        if not records:
            assert backward._bwd_records == {}, "records off: none written"
    named = names(first, (), "first:") if first is not None else {}
    named.update(names(x, device.buffers[made:]))
    buffers = [described(t) for buffers_ in device.buffers[made:] for t in buffers_]
    return Call(device.launches[start:], named, buffers, device.hits > hits, device.plans > plans,
                device.packs > packs)


def assert_record_matches_full_path(device: Device, case: Case, x: dict, first: dict, **options) -> list[tuple]:
    recorded = run(device, case, x, first, **options)
    assert recorded.hit, "the call takes the record"
    assert not recorded.planned and not recorded.packed, "a record skips planning and packing"
    full = run(device, case, x, first, records=False, **options)
    assert not full.hit and full.planned
    mine, expected = symbolic(recorded.launches, recorded.named), symbolic(full.launches, full.named)
    assert mine == expected
    assert recorded.buffers == full.buffers
    return expected


VARLEN = ((100, 130), (1, 7), (64, 64), (27, 200))
CASES = {
    "causal": (Case(), dict(causal=True)),
    "none-gqa": (Case(seqlen_q=113, seqlen_k=300, nheads=8, nheads_k=2, head_dim=128), {}),
    "mqa-causal": (Case(nheads=8, nheads_k=1, seqlen_k=200), dict(causal=True)),
    "local": (Case(seqlen_k=333, head_dim=128), dict(window_size=(32, 8))),
    "deterministic": (Case(head_dim=128), dict(causal=True, deterministic=True)),
    "deterministic-gqa": (Case(nheads=8, nheads_k=2, seqlen_q=200, seqlen_k=300), dict(deterministic=True)),
    "softcap": (Case(head_dim=96), dict(softcap=30.0, causal=True)),
    "alibi": (Case(alibi=1), dict(causal=True)),
    "alibi-per-batch": (Case(alibi=2, nheads=8, nheads_k=4), {}),
    "scale": (Case(), dict(softmax_scale=0.3)),
    "packed-qkv": (Case(layout="packed", head_dim=128), dict(causal=True)),
    "heads-first": (Case(layout="heads-first", nheads=8, nheads_k=2), dict(causal=True)),
    "d256-fp16": (Case(head_dim=256, dtype=torch.float16, batch=1, nheads=2, nheads_k=2), dict(causal=True)),
    "d192": (Case(head_dim=192, batch=1), {}),
    "varlen-causal": (Case(lengths=VARLEN), dict(causal=True)),
    "varlen-gqa": (Case(lengths=VARLEN, nheads=8, nheads_k=2, head_dim=128), {}),
    "varlen-deterministic": (Case(lengths=VARLEN, head_dim=128), dict(causal=True, deterministic=True)),
    "varlen-seqused": (Case(lengths=VARLEN, seqused=True), dict(causal=True)),
    "varlen-packed-softcap": (Case(lengths=((50, 50), (77, 77)), layout="packed"), dict(softcap=20.0)),
    "varlen-alibi-local": (Case(lengths=VARLEN, alibi=1), dict(window_size=(64, 0))),
}


@pytest.mark.parametrize("device", [HOPPER, AMPERE], indirect=True, ids=["sm90", "sm80"])
@pytest.mark.parametrize("name", CASES)
def test_a_repeated_call_launches_what_the_full_path_does(device, name):
    case, options = CASES[name]
    first = case.tensors()
    made = run(device, case, first, **options)
    assert not made.hit and made.planned and len(backward._bwd_records) == 1, "the first call records its launches"
    for x in (case.tensors(), first):  # fresh tensors of the description, then the first call's again
        launched = assert_record_matches_full_path(device, case, x, first, **options)
        assert [uri.split("_")[1] for uri, *_ in launched] == ["bwd", "bwd", "bwd"]  # pre, main, post
        if x is not first:
            assert not any(p.startswith("first:") for *_, pointers, _ in launched for p in pointers)


@pytest.mark.parametrize("name, sm90", [("causal", True), ("none-gqa", True), ("d256-fp16", True),
                                        ("varlen-deterministic", True), ("varlen-seqused", False)])
def test_hopper_records_the_sm90_backward_with_its_maps(device, name, sm90):
    """On Hopper the cases above run the sm90 backward (seqused: the sm80 one), whose record makes
    its five tensor maps per call from the call's Q, K, V, dO and dQ buffer."""
    case, options = CASES[name]
    x = case.tensors()
    run(device, case, x, **options)
    (record,) = backward._bwd_records.values()
    pre, main, post = record.launches
    assert main.spec.family == ("sm90" if sm90 else "sm80")
    assert (main.maps is not None) == sm90 and pre.maps is None and post.maps is None
    y = case.tensors()
    call = run(device, case, y, **options)
    if sm90:
        maps = call.launches[1].params[:SM90_MAPS["bwd"] * tma.TMA_MAP_BYTES]
        addresses = [POINTER.unpack_from(maps, i * tma.TMA_MAP_BYTES)[0] for i in range(SM90_MAPS["bwd"])]
        assert [call.named[a] for a in addresses] == ["q", "k", "v", "dout", "dq_accum"]


@pytest.mark.parametrize("device", [HOPPER, AMPERE], indirect=True, ids=["sm90", "sm80"])
def test_records_patch_every_pointer_they_hold(device):
    """Each recorded launch writes a call's pointer into every pointer field its params hold (a
    field left as the recording call packed it would point to that call's tensor)."""
    for case, options in CASES.values():
        bwd(case, case.tensors(), **options)
    assert len(backward._bwd_records) == len(CASES)
    for record in backward._bwd_records.values():
        assert record.scratch is not None and record.scratch.allocate is backward.bwd_buffers
        for launch in record.launches:
            layout = LAYOUTS[launch.spec.direction]
            held = {offset for field, offset in zip(layout.fields, layout.offsets)
                    if field.kind == "ptr" and POINTER.unpack_from(launch.params, offset)[0]}
            assert {offset for offset, _ in launch.pointers} == held


@pytest.mark.parametrize("name", ["varlen-causal", "causal"])
def test_varlen_zeroes_dk_and_dv_on_both_paths_dense_on_neither(device, name):
    """A varlen backward zeroes dK and dV before its kernels (rows outside every sequence get no
    gradient from them); a record does too. A dense one leaves them to the kernels."""
    case, options = CASES[name]
    run(device, case, case.tensors(), **options)
    for records in (True, False):
        x = case.tensors()
        x["dk"].fill_(float("nan"))
        x["dv"].fill_(float("nan"))
        assert run(device, case, x, records=records, **options).hit == records
        for grad in (x["dk"], x["dv"]):
            assert bool((grad == 0).all()) == bool(case.lengths)
            assert bool(grad.isnan().all()) == (not case.lengths)


def test_a_broken_record_fails_the_comparison(device):
    """The comparison sees a record that launches other than the full path: a pointer left
    unpatched (the first call's tensor), the maps of other tensors, buffers of another shape."""
    case, options = CASES["deterministic"]
    first = case.tensors()
    run(device, case, first, **options)
    (key, record), = backward._bwd_records.items()
    pre, main, post = record.launches
    maps_reversed = main.maps._replace(tensors=main.maps.tensors[::-1])
    other_semaphores = record.scratch._replace(sizes=(*record.scratch.sizes[:-1], (1, 1, 1, 1)))
    broken = {  # what the comparison's message shows: a stale pointer, the maps' order, a buffer's shape
        "first:": record._replace(launches=(pre, main._replace(pointers=main.pointers[1:]), post)),
        "'dq_accum', 'dout', 'v', 'k', 'q'": record._replace(launches=(pre, main._replace(maps=maps_reversed), post)),
        r"torch.Size\(\[1, 1, 1, 1\]\)": record._replace(scratch=other_semaphores),
    }
    for match, wrong in broken.items():
        backward._bwd_records[key] = wrong
        with pytest.raises(AssertionError, match=match):
            assert_record_matches_full_path(device, case, case.tensors(), first, **options)
    backward._bwd_records[key] = record
    assert_record_matches_full_path(device, case, case.tensors(), first, **options)


@pytest.mark.parametrize("device", [HOPPER, AMPERE], indirect=True, ids=["sm90", "sm80"])
@pytest.mark.parametrize("name", ["causal", "varlen-gqa"])
def test_dropout_takes_the_full_path(device, name):
    """A dropout backward's params hold its forward's RNG seed and offset: never recorded or
    replayed, each call packs its own."""
    case, options = CASES[name]
    x = case.tensors()
    for offset in (0, 4):
        call = run(device, case, x, dropout_p=0.1, rng_state=torch.tensor([7, offset]), **options)
        assert not call.hit and call.planned and backward._bwd_records == {}
        main = call.launches[1]
        assert struct.pack("<qq", 7, offset) in main.params  # philox_seed, philox_offset
    run(device, case, x, **options)
    assert len(backward._bwd_records) == 1
    call = run(device, case, x, dropout_p=0.1, rng_state=torch.tensor([7, 8]), **options)
    assert not call.hit and call.launches[1].spec.dropout, "a record without dropout serves no dropout call"


def test_the_key_separates_what_changes_the_launch(device, monkeypatch):
    case = Case(nheads=8, nheads_k=2)
    x = case.tensors()
    run(device, case, x)
    records = 1

    def another(case_: Case, y: dict, **options) -> None:
        nonlocal records
        assert not run(device, case_, y, **options).hit
        records += 1
        assert len(backward._bwd_records) == records
        assert run(device, case_, y, **options).hit  # and leaves its own

    another(case, x, causal=True)
    another(case, x, window_size=(16, 16))
    another(case, x, softcap=5.0)
    another(case, x, softmax_scale=0.5)
    another(case, x, deterministic=True)
    another(case, {**x, "alibi_slopes": torch.rand(8)})
    another(case, {**x, "alibi_slopes": torch.rand(2, 8)})
    another(case, {**x, "dout": x["dout"].transpose(1, 2).contiguous().transpose(1, 2)})  # dO's strides
    heads_first = {name: torch.empty(2, 2, 128, 64, dtype=torch.bfloat16).transpose(1, 2) for name in ("v", "dk", "dv")}
    another(case, {**x, "dq": torch.empty(2, 8, 128, 64, dtype=torch.bfloat16).transpose(1, 2)})  # dQ's strides
    for name, t in heads_first.items():  # V's, dK's, dV's
        another(case, {**x, name: t})
    another(Case(nheads=8, nheads_k=2, seqlen_k=256), Case(nheads=8, nheads_k=2, seqlen_k=256).tensors())
    half = Case(nheads=8, nheads_k=2, dtype=torch.float16)
    another(half, half.tensors())
    with tuning.use(bwd_causal_chunk_waves=0):
        another(case, x)
    monkeypatch.setenv("FLASHGEN_FAMILY", "sm80")
    another(case, x)
    monkeypatch.delenv("FLASHGEN_FAMILY")
    varlen = Case(lengths=VARLEN)
    y = varlen.tensors()
    another(varlen, y)
    another(Case(lengths=((100, 130), (1, 7), (64, 64), (27, 199))), y)  # another max_seqlen_k, same tensors
    more = Case(lengths=((100, 130), (1, 7), (32, 32), (32, 32), (27, 200)))  # one more sequence, same rows
    another(more, more.tensors())
    seqused = Case(lengths=VARLEN, seqused=True)
    another(seqused, seqused.tensors())


def test_copies_and_misaligned_tensors_take_the_full_path(device):
    case = Case()
    x = case.tensors()

    def off_by(t: torch.Tensor, elements: int) -> torch.Tensor:
        """t's values in a view of its shape and strides that starts ``elements`` off 16 bytes."""
        base = torch.empty(t.numel() + 8, dtype=t.dtype)
        view = base[elements:elements + t.numel()].view(t.shape)
        view.copy_(t)
        return view

    call = run(device, case, {**x, "q": off_by(x["q"], 4)})
    assert not call.hit and backward._bwd_records == {}, "a misaligned q: copied, no record"
    run(device, case, x)
    assert len(backward._bwd_records) == 1
    for changed in ("q", "k", "v", "dout", "dk", "dv"):
        view = off_by(x[changed], 1)  # 2 bytes off
        call = run(device, case, {**x, changed: view})
        assert not call.hit, f"a misaligned {changed}: the full path"
        main = call.launches[1]
        assert struct.pack("<Q", view.data_ptr()) not in main.params, "on a copy"
    assert len(backward._bwd_records) == 1 and run(device, case, x).hit, "the record kept"
    # dk and dv with rows of 130 (aligned, not in whole chunks): a dense copy each time, no record
    odd = Case(seqlen_k=256)
    y = odd.tensors()
    y.update(dk=torch.empty(2, 256, 4, 130, dtype=torch.bfloat16)[..., :64],
             dv=torch.empty(2, 256, 4, 130, dtype=torch.bfloat16)[..., :64])
    for _ in range(2):
        call = run(device, odd, y)
        assert not call.hit and "dk" not in str(symbolic(call.launches, call.named))
    assert len(backward._bwd_records) == 1, "copied: never recorded"


def test_one_tensor_as_q_k_and_v(device):
    """Self-attention on one buffer: recorded with it in q's slot (its key says so); three tensors
    are another description."""
    case = Case()
    x = case.tensors()
    one = dict(x, k=x["q"], v=x["q"])
    run(device, case, one)
    assert len(backward._bwd_records) == 1
    y = case.tensors()
    launched = assert_record_matches_full_path(device, case, dict(y, k=y["q"], v=y["q"]), one)
    assert launched[1][6][:4] == ("q", "q", "q", "dout")
    assert not run(device, case, x).hit and len(backward._bwd_records) == 2


def test_a_tensor_passed_twice_is_not_recorded(device):
    """dO passed as the forward's output too: which slot a later call's pointer comes from would
    be a guess, so no record; such a call takes one made of distinct tensors, correctly."""
    case = Case()
    x = case.tensors()
    run(device, case, dict(x, dout=x["out"]))
    assert backward._bwd_records == {}
    run(device, case, x)
    y = case.tensors()
    assert_record_matches_full_path(device, case, dict(y, dout=y["out"]), x)


def test_empty_calls_zero_the_gradients_without_records(device):
    case = Case(seqlen_q=0)
    x = case.tensors()
    for grad in ("dq", "dk", "dv"):
        x[grad].fill_(1.0)
    for _ in range(2):
        call = run(device, case, x)
        assert not call.launches and not call.hit and backward._bwd_records == {}
    assert all(bool((x[grad] == 0).all()) for grad in ("dq", "dk", "dv"))


def test_the_record_cache_is_bounded(device, monkeypatch):
    monkeypatch.setattr(backward._bwd_records, "capacity", 2)
    for seqlen in (64, 128, 256):
        case = Case(seqlen_q=seqlen)
        run(device, case, case.tensors())
    assert len(backward._bwd_records) == 1  # cleared when full
    case = Case(seqlen_q=32)
    x = case.tensors()
    with backward._bwd_records.off():
        assert not run(device, case, x).hit and backward._bwd_records == {}
    assert len(backward._bwd_records) == 1, "off() keeps the records made before"
    monkeypatch.setattr(backward._bwd_records, "capacity", 0)
    run(device, case, x)
    assert not run(device, case, x).hit and len(backward._bwd_records) == 1


@pytest.mark.parametrize("device", [HOPPER, AMPERE], indirect=True, ids=["sm90", "sm80"])
def test_training_steps_take_the_record_through_autograd(device):
    """flash_attn_func's backward through autograd: the second step's backward takes the first's
    record and launches what the full path does."""
    case = Case(nheads=8, nheads_k=2)

    def step(records: bool) -> Call:
        x = case.tensors()
        q, k, v = (x[name].requires_grad_() for name in ("q", "k", "v"))
        with interface._fwd_records.off():  # (the forward's records are another test's)
            out = flashgen.flash_attn_func(q, k, v, causal=True)
        start, hits, made = len(device.launches), device.hits, len(device.buffers)
        with contextlib.nullcontext() if records else backward._bwd_records.off():
            out.backward(x["dout"])
        named = names(dict(q=q, k=k, v=v, dout=x["dout"], out=out, dq=q.grad, dk=k.grad, dv=v.grad),
                      device.buffers[made:])
        return Call(device.launches[start:], named, [], device.hits > hits, False, False)

    assert not step(True).hit and len(backward._bwd_records) == 1
    mine, full = step(True), step(False)
    assert mine.hit and not full.hit
    assert symbolic(mine.launches, mine.named) == symbolic(full.launches, full.named)
