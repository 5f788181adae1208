"""CPU tier: the Params layout against ctypes' C layout, and the fast divmod constants."""
from __future__ import annotations

import ctypes

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flashgen.generator.params import FWD_LAYOUT, FWD_PARAMS, fast_div, fast_divmod, pack_fwd


class FastDivmod(ctypes.Structure):
    _fields_ = [("divisor", ctypes.c_int), ("multiplier", ctypes.c_uint), ("shift", ctypes.c_uint)]


# Independent of params.py's size/alignment table: ctypes applies the platform's C rules.
_CTYPES = {
    "ptr": ctypes.c_void_p,
    "i64": ctypes.c_longlong,
    "i32": ctypes.c_int,
    "u32": ctypes.c_uint,
    "f32": ctypes.c_float,
    "divmod": FastDivmod,
}


class FwdParamsC(ctypes.Structure):
    _fields_ = [(f.name, _CTYPES[f.kind]) for f in FWD_PARAMS]


def test_offsets_and_size_match_c_layout():
    for field, offset in zip(FWD_LAYOUT.fields, FWD_LAYOUT.offsets):
        assert getattr(FwdParamsC, field.name).offset == offset, field.name
    assert ctypes.sizeof(FwdParamsC) == FWD_LAYOUT.size


def test_packed_bytes_read_back_through_c_layout():
    """Each field lands where C reads it: distinct values, packed, then read through ctypes."""
    values = {}
    for i, f in enumerate(FWD_PARAMS, start=1):
        if f.kind == "divmod":
            values[f.name] = fast_divmod(i + 2)
        elif f.kind == "f32":
            values[f.name] = i + 0.5
        elif f.kind == "ptr":
            values[f.name] = 0x10000 * i
        else:
            values[f.name] = -i if f.kind in ("i32", "i64") else i
    packed = pack_fwd(values)
    assert len(packed) == FWD_LAYOUT.size
    c_params = FwdParamsC.from_buffer_copy(packed)
    for f in FWD_PARAMS:
        got = getattr(c_params, f.name)
        if f.kind == "divmod":
            assert (got.divisor, got.multiplier, got.shift) == values[f.name], f.name
        else:
            assert got == values[f.name], f.name


def _device_div(n: int, divisor: int) -> int:
    """fast_div, also checking that each step fits the device's 32-bit registers."""
    value = fast_divmod(divisor)
    _, multiplier, shift = value
    assert 0 <= multiplier < 2**32 and 0 <= shift <= 31
    assert ((n * multiplier) >> 32) + n < 2**32  # umulhi(n, m) + n must not overflow
    return fast_div(n, value)


SMALL_DIVISORS = [1, 2, 3, 5, 6, 7, 8, 9, 12, 16, 31, 32, 33, 48, 64, 96, 127, 128, 255, 1000]


@pytest.mark.parametrize("divisor", SMALL_DIVISORS)
def test_fast_divmod_exact_for_a_range(divisor):
    for n in range(5000):
        assert _device_div(n, divisor) == n // divisor, (n, divisor)


POWERS_OF_TWO = [2**k for k in range(31)]
EDGE_DIVISORS = [1, 2, 3, 7, 2**31 - 1, 2**30 + 1, 2**16 + 1, 641, 6700417] + POWERS_OF_TWO


@pytest.mark.parametrize("divisor", EDGE_DIVISORS)
def test_fast_divmod_exact_near_the_ends(divisor):
    for n in [0, 1, divisor - 1, divisor, divisor + 1, 2**31 - 2, 2**31 - 1]:
        if 0 <= n < 2**31:
            assert _device_div(n, divisor) == n // divisor, (n, divisor)


@settings(max_examples=2000, deadline=None)
@given(
    divisor=st.one_of(st.sampled_from(EDGE_DIVISORS), st.integers(1, 2**31 - 1)),
    n=st.integers(0, 2**31 - 1),
)
@example(divisor=3, n=2**31 - 1)
@example(divisor=7, n=2**31 - 2)
def test_fast_divmod_exact_for_random_values(divisor, n):
    assert _device_div(n, divisor) == n // divisor


@pytest.mark.parametrize("divisor", [0, -1, 2**31])
def test_fast_divmod_rejects_out_of_range(divisor):
    with pytest.raises(ValueError, match="divisor"):
        fast_divmod(divisor)
