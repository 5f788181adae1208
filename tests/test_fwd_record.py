"""CPU tier: a repeated dense forward takes its launch record (execute.LaunchRecord) and launches
exactly what the full path would: same kernel, grid, shared memory and params bytes, with the new
call's pointers and tensor maps. No GPU: the device, tensor maps and launches are stand-ins."""
from __future__ import annotations

import struct

import pytest
import torch

from flashgen.runtime import execute, interface, tma
from flashgen.runtime.device import DeviceInfo

HOPPER = DeviceInfo(capability=(9, 0), num_sms=132, l2_bytes=50 << 20, smem_per_sm=228 << 10)
AMPERE = DeviceInfo(capability=(8, 0), num_sms=108, l2_bytes=40 << 20, smem_per_sm=164 << 10)


@pytest.fixture
def launches(monkeypatch, request):
    seen = []
    info = getattr(request, "param", HOPPER)
    monkeypatch.setattr(interface, "device_info", lambda index: info)
    monkeypatch.setattr(interface, "device_index", lambda t: 0)
    monkeypatch.setattr(execute, "device_index", lambda t: 0)
    monkeypatch.setattr(execute, "launch_kernel", lambda spec, smem, threads, grid, params, index, dependent=False,
                        cluster=None: seen.append((spec.uri, smem, threads, grid, params, dependent, cluster)))
    # A map that names its tensor: a reused map of another call's tensor would show.
    monkeypatch.setattr(tma, "tensor_map", lambda t, rows, group=1: struct.pack("<QQQ", t.data_ptr(), rows, group) + bytes(104))
    monkeypatch.setattr(interface, "_fwd_records", execute.LaunchRecords())
    return seen


def tensors(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype=torch.bfloat16):
    return (torch.randn(batch, seqlen_q, nheads, head_dim, dtype=dtype),
            torch.randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype),
            torch.randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype))


def forward(q, k, v, causal=True, window=(-1, 0), softcap=0.0, alibi=None, pack_gqa=None, dropout_p=0.0):
    scale = q.shape[-1] ** -0.5
    out, lse, _ = interface._fwd(q, k, v, scale, causal, window, softcap, alibi, pack_gqa, 1, dropout_p)
    return out, lse


def full_path(monkeypatch, q, k, v, **options):
    """What the full path launches for this call (no record read or written)."""
    kept = dict(interface._fwd_records)
    with interface._fwd_records.off():
        result = forward(q, k, v, **options)
        assert interface._fwd_records == {}, "records off: none written"
    assert interface._fwd_records == kept, "and those kept before are kept after"
    return result


@pytest.mark.parametrize("launches", [HOPPER, AMPERE], indirect=True, ids=["sm90", "sm80"])
@pytest.mark.parametrize("case", [
    dict(shape=(2, 128, 256, 16, 16, 128)),
    dict(shape=(1, 113, 1023, 8, 2, 64), causal=False, window=(-1, -1)),
    dict(shape=(3, 1, 512, 32, 8, 128), causal=False, window=(-1, -1), pack_gqa=True),  # decode rows
    dict(shape=(2, 200, 200, 4, 4, 256), softcap=30.0),
    dict(shape=(2, 64, 333, 4, 1, 64), window=(32, 0)),
])
def test_a_repeated_call_launches_what_the_full_path_does(launches, monkeypatch, case):
    case = dict(case)
    shape = case.pop("shape")
    first = tensors(*shape)
    forward(*first, **case)
    assert len(interface._fwd_records) == 1, "the first call records its launch"
    second = tensors(*shape)  # other pointers, same description
    out, lse = forward(*second, **case)
    recorded = launches[-1]
    full_out, full_lse = full_path(monkeypatch, *second, **case)
    expected = launches[-1]
    # The two calls' outputs are other allocations: their pointers swapped, the bytes must agree.
    params = recorded[4]
    for mine, theirs in ((out, full_out), (lse, full_lse)):
        assert params.count(struct.pack("<Q", mine.data_ptr())) == 1
        params = params.replace(struct.pack("<Q", mine.data_ptr()), struct.pack("<Q", theirs.data_ptr()))
    assert (*recorded[:4], params, *recorded[5:]) == expected
    assert out.shape == second[0].shape and lse.shape == (shape[0], shape[3], shape[1])


def test_pointers_land_in_the_params(launches):
    q, k, v = tensors(2, 128, 128, 4, 4, 64)
    forward(q, k, v)
    q2, k2, v2 = tensors(2, 128, 128, 4, 4, 64)
    out, lse = forward(q2, k2, v2)
    params = launches[-1][4]
    for t in (q2, k2, v2, out, lse):
        assert struct.pack("<Q", t.data_ptr()) in params
    assert struct.pack("<Q", q.data_ptr()) not in params


def test_calls_that_need_more_than_the_record_take_the_full_path(launches, monkeypatch):
    from flashgen.runtime.dropout import DropoutState

    monkeypatch.setattr(interface, "draw_dropout", lambda p, index: DropoutState(p, 1, 0))
    q, k, v = tensors(2, 128, 128, 4, 4, 64)
    forward(q, k, v, alibi=torch.rand(4, dtype=torch.float32))
    forward(q, k, v, dropout_p=0.1)
    assert interface._fwd_records == {}  # ALiBi slopes and dropout state are per call
    forward(*tensors(2, 64, 64, 4, 4, 96))
    assert interface._fwd_records == {}  # d96 runs the d128 sm90 instance into a padded O, copied out
    base = torch.randn(2 * 128 * 4 * 64 + 4, dtype=torch.bfloat16)
    misaligned = base[4:].view(2, 128, 4, 64)  # 8 bytes off: a copy in 16-byte chunks
    forward(misaligned, k, v)
    assert interface._fwd_records == {}  # a call on copies records nothing
    forward(q, k, v)
    assert len(interface._fwd_records) == 1
    recorded_launch = len(launches)
    forward(misaligned, k, v)  # same description, misaligned: the full path again, on a copy
    assert len(launches) == recorded_launch + 1
    assert struct.pack("<Q", misaligned.data_ptr()) not in launches[-1][4]


def test_the_key_separates_what_changes_the_launch(launches, monkeypatch):
    q, k, v = tensors(2, 128, 128, 4, 4, 64)
    forward(q, k, v)
    forward(q, k, v, causal=False, window=(-1, -1))
    forward(q, k, v, softcap=5.0)
    forward(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)  # other strides
    monkeypatch.setenv("FLASHGEN_FAMILY", "sm80")
    forward(q, k, v)
    assert len(interface._fwd_records) == 5
    assert launches[-1][0].startswith("flash_fwd_sm80")
