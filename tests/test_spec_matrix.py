"""CPU tier: the spec's URI and the one kernel matrix."""
from __future__ import annotations

import itertools
import re

import pytest

from flashgen.generator import matrix
from flashgen.generator.spec import COMBINE_DTYPES, DTYPES, HEAD_DIMS, MASKS, KernelSpec

# Fixed field order: direction, family, head dim, dtype, then each flag only when on, then arch.
URI_PATTERN = re.compile(
    r"flash_(?P<direction>fwd|bwd|append|combine|bwd_pre|bwd_post)_(?P<family>sm\d+)(?:_hdim(?P<head_dim>\d+))?_(?P<dtype>fp16|bf16|fp32)"
    r"(?:_(?P<mask>causal|local))?(?P<softcap>_softcap)?(?P<pack_gqa>_packgqa)?(?P<paged>_paged)?"
    r"(?P<decode>_decode)?(?P<dropout>_dropout)?(?P<split>_split)?(?P<gather>_gather)?_(?P<arch>sm\d+a?)"
)
# softcap, pack_gqa, paged, decode; plus the dropout variants of the unpaged, non-decode ones
FWD_PER_ARCH = len(DTYPES) * len(HEAD_DIMS) * len(MASKS) * (2 * 2 * 2 * 2 + 2 * 2)
BWD_PER_ARCH = len(DTYPES) * len(HEAD_DIMS) * len(MASKS) * 2 * 2  # softcap, dropout
# + append, combine, bwd_pre, bwd_post
PER_ARCH = FWD_PER_ARCH + BWD_PER_ARCH + len(DTYPES) + len(COMBINE_DTYPES) + 2 * len(DTYPES)
# The sm90 forward (sm_90a only): dtypes x its head dims x (none, causal, local) x softcap x PackGQA.
# softcap x PackGQA x (unpaged, paged by TMA, paged gathered) x split, plus dropout for the
# unpacked, unsplit, unpaged ones (softcap)
SM90_FWD = len(DTYPES) * len(matrix.SM90_FWD_HEAD_DIMS) * len(matrix.SM90_FWD_MASKS) * (2 * 2 * 3 * 2 + 2)
SM90_BWD = len(DTYPES) * len(matrix.SM90_BWD_HEAD_DIMS) * len(MASKS) * 2 * 2  # softcap, dropout


def test_uris_unique_and_readable():
    specs = matrix.all_specs()
    assert len({s.uri for s in specs}) == len(specs)
    for spec in specs:
        match = URI_PATTERN.fullmatch(spec.uri)
        assert match, spec.uri
        # The URI spells every field back: nothing is lost or reordered.
        assert match["direction"] == spec.direction
        assert match["family"] == spec.family
        assert int(match["head_dim"] or 0) == spec.head_dim
        assert match["dtype"] == spec.dtype
        assert (match["mask"] or "none") == spec.mask
        assert bool(match["softcap"]) == spec.softcap
        assert bool(match["pack_gqa"]) == spec.pack_gqa
        assert bool(match["paged"]) == spec.paged
        assert bool(match["decode"]) == spec.decode
        assert bool(match["dropout"]) == spec.dropout
        assert bool(match["split"]) == spec.split
        assert bool(match["gather"]) == spec.gather
        assert match["arch"] == spec.arch.replace("_", "")


def test_flags_appear_only_when_on():
    plain = KernelSpec("fwd", "sm80", "sm_80", "bf16", 128)
    assert plain.uri == "flash_fwd_sm80_hdim128_bf16_sm80"
    assert not {"none", "False", "True", "causal", "softcap", "packgqa"} & set(plain.uri.split("_"))
    full = KernelSpec("fwd", "sm80", "sm_90a", "fp16", 64, "local", softcap=True, pack_gqa=True)
    assert full.uri == "flash_fwd_sm80_hdim64_fp16_local_softcap_packgqa_sm90a"


def test_spec_round_trips_and_rejects_bad_fields():
    spec = KernelSpec("fwd", "sm80", "sm_86", "fp16", 96, "causal", pack_gqa=True)
    assert KernelSpec.from_dict(spec.to_dict()) == spec
    assert spec.compute_capability == 86
    with pytest.raises(ValueError, match="head_dim"):
        KernelSpec("fwd", "sm80", "sm_80", "bf16", 100)
    with pytest.raises(ValueError, match="dtype"):
        KernelSpec("fwd", "sm80", "sm_80", "fp32", 128)
    with pytest.raises(ValueError, match="dropout"):
        KernelSpec("fwd", "sm80", "sm_80", "bf16", 128, paged=True, dropout=True)
    with pytest.raises(ValueError, match="split"):
        KernelSpec("fwd", "sm80", "sm_80", "bf16", 128, split=True)  # sm80 splits at run time
    assert KernelSpec("fwd", "sm90", "sm_90a", "bf16", 128, split=True).uri == "flash_fwd_sm90_hdim128_bf16_split_sm90a"


def test_matrix_counts():
    assert len(matrix.all_specs()) == PER_ARCH * len(matrix.ALL_ARCHS) + SM90_FWD + SM90_BWD
    for arch in matrix.ALL_ARCHS:
        specs = matrix.all_specs(archs=[arch])
        assert len(specs) == PER_ARCH + (SM90_FWD + SM90_BWD if arch == "sm_90a" else 0)
        assert {s.arch for s in specs} == {arch}
    assert len(matrix.all_specs(directions=["fwd"], archs=["sm_80", "sm_90a"])) == 2 * FWD_PER_ARCH + SM90_FWD
    sm90 = [s for s in matrix.all_specs() if s.family == "sm90"]
    assert len(sm90) == SM90_FWD + SM90_BWD
    sm90_fwd = [s for s in sm90 if s.direction == "fwd"]
    sm90_bwd = [s for s in sm90 if s.direction == "bwd"]
    assert len(sm90_fwd) == SM90_FWD and len(sm90_bwd) == SM90_BWD
    assert all(s.arch == "sm_90a" and not s.decode for s in sm90)
    assert all(s.direction == "fwd" for s in sm90 if s.paged)
    assert all(s.paged and s.direction == "fwd" for s in sm90 if s.gather)
    assert all(not (s.pack_gqa or s.split or s.paged) for s in sm90 if s.dropout)
    assert all(s.head_dim in matrix.SM90_FWD_HEAD_DIMS for s in sm90_fwd)
    assert all(s.head_dim in matrix.SM90_BWD_HEAD_DIMS and not s.pack_gqa for s in sm90_bwd)
    for specs in (sm90_fwd, sm90_bwd):
        assert {(s.mask, s.softcap) for s in specs} == {(m, c) for m in MASKS for c in (False, True)}
    assert matrix.all_specs(directions=["varlen"]) == []
    assert matrix.all_specs() == sorted(matrix.all_specs())


def test_every_spec_is_in_matrix_and_its_family_matches():
    for spec in matrix.all_specs():
        assert matrix.is_in_matrix(spec)
        assert spec.family in matrix.families(spec.arch)
        # Only the forward and the backward's main kernel have a second family; every other kernel
        # is the base family's.
        assert spec.family == matrix.family_for(spec.arch) or spec.direction in ("fwd", "bwd")
    assert matrix.families("sm_90a") == ("sm80", "sm90") and matrix.families("sm_86") == ("sm80",)
    with pytest.raises(ValueError, match="sm_75"):
        matrix.family_for("sm_75")


def test_find_instance_says_which_instances_exist():
    assert all(matrix.find_instance(**spec.to_dict()) == spec for spec in matrix.all_specs())
    sm90 = dict(direction="fwd", family="sm90", arch="sm_90a", dtype="bf16", head_dim=128, mask="causal")
    assert matrix.find_instance(**sm90, pack_gqa=True, paged=True, split=True, gather=True) is not None
    for change in (dict(head_dim=96), dict(arch="sm_80"), dict(dtype="fp32"),  # not in the matrix
                   dict(decode=True), dict(dropout=True, pack_gqa=True), dict(dropout=True, split=True),
                   dict(dropout=True, paged=True), dict(gather=True)):  # no instance can take them
        assert matrix.find_instance(**{**sm90, **change}) is None, change


@pytest.mark.parametrize(
    "capability, arch",
    [((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 7), "sm_80"), ((8, 9), "sm_86"), ((9, 0), "sm_90a")],
)
def test_target_arch(capability, arch):
    assert matrix.target_arch(*capability) == arch
    assert arch in matrix.ALL_ARCHS


@pytest.mark.parametrize("capability", [(7, 5), (7, 0), (6, 1), (10, 0), (12, 0)])
def test_target_arch_rejects_unsupported(capability):
    with pytest.raises(RuntimeError, match=r"{}\.{}".format(*capability)):
        matrix.target_arch(*capability)


def test_every_capability_maps_into_the_matrix():
    for major, minor in itertools.product((8, 9), range(10)):
        assert matrix.target_arch(major, minor) in matrix.ALL_ARCHS


@pytest.mark.parametrize("change, error", [
    (dict(direction="bwd", paged=True), "backward"), (dict(decode=True), "sm90 family"),
    (dict(dropout=True, pack_gqa=True), "sm90 dropout"), (dict(dropout=True, split=True), "sm90 dropout"),
    (dict(dropout=True, paged=True), "dropout is for training"),
    (dict(dropout=True, direction="bwd", pack_gqa=True), "backward|sm90 dropout"),
])
def test_sm90_spec_has_no_backward_paging_decode_or_packed_dropout(change, error):
    fields = dict(direction="fwd", family="sm90", arch="sm_90a", dtype="bf16", head_dim=128, mask="none")
    KernelSpec(**fields)  # the plain forward is valid, also with a local mask and softcap
    KernelSpec(**{**fields, "mask": "local", "softcap": True, "pack_gqa": True})
    KernelSpec(**{**fields, "direction": "bwd", "mask": "causal", "softcap": True})  # and the backward
    KernelSpec(**{**fields, "paged": True, "pack_gqa": True, "split": True})  # the paged forward
    KernelSpec(**{**fields, "mask": "causal", "dropout": True})  # the unpacked, unsplit forward with dropout
    with pytest.raises(ValueError, match=error):
        KernelSpec(**{**fields, **change})
    with pytest.raises(ValueError, match="PackGQA"):
        KernelSpec(**{**fields, "direction": "bwd", "pack_gqa": True})
