"""The one matrix of kernel instances. The CLI, CI builds, generated/, the runtime's dispatch and
the tests all read it; nothing else lists instances.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import re
from typing import Iterable, Iterator

from . import render
from .spec import COMBINE_DTYPES, DTYPES, HEAD_DIMS, MASKS, KernelSpec

# NVRTC targets each family is built for.  A cubin runs on its own major version at the same or a
# higher minor version, so sm_80 serves 8.0 and 8.7, sm_86 serves 8.6 and 8.9 (99 KB of shared
# memory, hence smaller tiles for large head dims), and sm_90a serves Hopper.  An sm_86 instance
# that compiles the same as its sm_80 twin runs the sm_80 cubin (compile_target).
FAMILY_ARCHS = {
    "sm80": ("sm_80", "sm_86", "sm_90a"),
    "sm90": ("sm_90a",),
}
# The family of every kernel but the sm90 forward's and backward's (combine, append, row kernels).
BASE_FAMILY = "sm80"
# Head dims with an sm90 forward instance: whole 64-column TMA panels (fwd_sm90.cuh). A call with a
# smaller head dim (a multiple of 8) runs the next one up: the TMA zero-fills the columns past the
# tensor's, which add nothing to Q·Kᵀ, and the kernel stores O into a padded buffer (run_fwd).
SM90_FWD_HEAD_DIMS = (64, 128, 192, 256)
SM90_FWD_MASKS = ("none", "causal", "local")
# Head dims with an sm90 backward instance (bwd_sm90.cuh: up to d128 a consumer's dK and dV of 64
# keys and every column in registers, at d192 and d256 of its share of the columns); smaller head
# dims run on the next one up. Every mask and softcap.
SM90_BWD_HEAD_DIMS = (64, 128, 192, 256)
ALL_ARCHS = tuple(dict.fromkeys(a for archs in FAMILY_ARCHS.values() for a in archs))


def target_arch(major: int, minor: int) -> str:
    """The NVRTC target whose cubins run on a device of compute capability major.minor."""
    if major < 8:
        raise RuntimeError(
            f"flashgen needs an NVIDIA GPU of compute capability 8.0 (Ampere) or newer; "
            f"this one is {major}.{minor}"
        )
    if major == 8:
        return "sm_86" if minor in (6, 9) else "sm_80"
    if major == 9:
        return "sm_90a"
    raise RuntimeError(
        f"compute capability {major}.{minor} has no kernel family in flashgen yet "
        f"(supported: 8.0-9.0)"
    )


def family_for(arch: str) -> str:
    """The base kernel family on an NVRTC target: sm80, whose kernels cover every call. (On sm_90a
    the forward prefers the sm90 family where it has an instance: dispatch.plan_fwd.)"""
    if arch in FAMILY_ARCHS[BASE_FAMILY]:
        return BASE_FAMILY
    raise ValueError(f"arch {arch!r} is not in the matrix; known: {ALL_ARCHS}")


def families(arch: str) -> tuple[str, ...]:
    """The kernel families built for an NVRTC target."""
    return tuple(family for family, archs in FAMILY_ARCHS.items() if arch in archs)


# A comparison of __CUDA_ARCH__ with a number, and the uses of the macro that do not read its value.
_ARCH_COMPARISON = re.compile(r"\b__CUDA_ARCH__\s*(>=|<=|==|!=|>|<)\s*(\d+)")
_ARCH_DEFINED = re.compile(r"\bdefined\s*\(?\s*__CUDA_ARCH__\b|#\s*ifn?def\s+__CUDA_ARCH__\b")
_ARCH_MACRO = re.compile(r"\b__CUDA_ARCH__\b")
_COMPARE = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
            ">": operator.gt, "<": operator.lt}


def _capability(arch: str) -> int:
    """86 for sm_86, 90 for sm_90a."""
    return int("".join(ch for ch in arch[3:] if ch.isdigit()))


def _cubin_portable(arch: str) -> bool:
    """Whether a cubin for ``arch`` runs on the later minor versions of its major.  An
    arch-specific target (sm_90a) runs on its own compute capability only."""
    return arch[-1].isdigit()


def arch_tests_agree(text: str, arch: str, other: str) -> bool:
    """Whether the preprocessor takes the same branches through ``text`` for both arches: every
    comparison of __CUDA_ARCH__ with a number is equally true for both, and the macro is used no
    other way (any other use counts as a difference)."""
    comparisons = _ARCH_COMPARISON.findall(text)
    if len(comparisons) + len(_ARCH_DEFINED.findall(text)) != len(_ARCH_MACRO.findall(text)):
        return False
    values = (_capability(arch) * 10, _capability(other) * 10)
    return all(_COMPARE[op](values[0], int(n)) == _COMPARE[op](values[1], int(n)) for op, n in comparisons)


def _source_without_identity(spec: KernelSpec) -> str:
    """The rendered instance minus the two places that name the instance itself, and with it the
    arch: its entry point's name and the spec comment."""
    source = render.render_instance(spec).replace(render.spec_json(spec), "<spec>")
    return source.replace(spec.kernel_name, "<kernel>")


@functools.cache
def _headers_agree(arch: str, other: str) -> bool:
    # The CUDA headers NVRTC brings are not read: none of them tells 8.0 from 8.6 apart.
    return arch_tests_agree("\n".join(render.header_sources().values()), arch, other)


@functools.lru_cache(maxsize=None)
def compile_target(spec: KernelSpec) -> KernelSpec:
    """The instance whose cubin serves ``spec``: the same instance for the lowest arch of its
    family and major version that compiles the same program, i.e. renders the same source but for
    the instance's own name, with no __CUDA_ARCH__ test in source or headers that tells the two
    apart.  So the sm_80 cubin serves an sm_86 instance whose tile is sm_80's.  Arch-specific
    targets (sm_90a) neither serve nor are served; ``spec`` itself when no lower arch qualifies or
    it is not in the matrix.  Decided once per process from the templates it finds."""
    if spec not in _MATRIX_SET or not _cubin_portable(spec.arch):
        return spec
    major = _capability(spec.arch) // 10
    lower = sorted(
        (arch for arch in FAMILY_ARCHS[spec.family]
         if _cubin_portable(arch) and _capability(arch) // 10 == major and _capability(arch) < _capability(spec.arch)),
        key=_capability,
    )
    source = _source_without_identity(spec)
    for arch in lower:
        candidate = dataclasses.replace(spec, arch=arch)
        if (candidate in _MATRIX_SET and _source_without_identity(candidate) == source
                and arch_tests_agree(source, arch, spec.arch) and _headers_agree(arch, spec.arch)):
            return candidate
    return spec


def compile_targets(specs: Iterable[KernelSpec]) -> list[KernelSpec]:
    """The distinct compile targets of ``specs`` (compile_target), in the order first met: what
    building ``specs`` compiles."""
    return list(dict.fromkeys(compile_target(spec) for spec in specs))


def fwd_specs(archs: Iterable[str] | None = None) -> Iterator[KernelSpec]:
    flags = (False, True)
    for arch, dtype, head_dim, mask, softcap, pack_gqa, paged, decode, dropout in itertools.product(
        FAMILY_ARCHS[BASE_FAMILY], DTYPES, HEAD_DIMS, MASKS, flags, flags, flags, flags, flags
    ):
        if archs is not None and arch not in archs:
            continue
        if dropout and (paged or decode):  # dropout is for training (see spec.py)
            continue
        yield KernelSpec("fwd", BASE_FAMILY, arch, dtype, head_dim, mask, softcap, pack_gqa, paged, decode, dropout)
    # sm90: split-KV and paged K/V are instance switches (fwd_sm90.cuh: kSplit, kPaged, and for
    # pages that split key blocks kGather), so calls without them run no code of them; dropout
    # (training) for the unpacked, unsplit, unpaged ones.
    for arch, dtype, head_dim, mask, softcap, pack_gqa, paged, split, dropout, gather in itertools.product(
        FAMILY_ARCHS["sm90"], DTYPES, SM90_FWD_HEAD_DIMS, SM90_FWD_MASKS, flags, flags, flags, flags, flags, flags
    ):
        if (dropout and (pack_gqa or split or paged)) or (gather and not paged):
            continue
        if archs is None or arch in archs:
            yield KernelSpec("fwd", "sm90", arch, dtype, head_dim, mask, softcap, pack_gqa, paged,
                             dropout=dropout, split=split, gather=gather)


def append_specs(archs: Iterable[str] | None = None) -> Iterator[KernelSpec]:
    for arch, dtype in itertools.product(FAMILY_ARCHS[BASE_FAMILY], DTYPES):
        if archs is None or arch in archs:
            yield KernelSpec("append", BASE_FAMILY, arch, dtype)


def combine_specs(archs: Iterable[str] | None = None) -> Iterator[KernelSpec]:
    for arch, dtype in itertools.product(FAMILY_ARCHS[BASE_FAMILY], COMBINE_DTYPES):
        if archs is None or arch in archs:
            yield KernelSpec("combine", BASE_FAMILY, arch, dtype)


def bwd_specs(archs: Iterable[str] | None = None) -> Iterator[KernelSpec]:
    for arch, dtype, head_dim, mask, softcap, dropout in itertools.product(
        FAMILY_ARCHS[BASE_FAMILY], DTYPES, HEAD_DIMS, MASKS, (False, True), (False, True)
    ):
        if archs is None or arch in archs:
            yield KernelSpec("bwd", BASE_FAMILY, arch, dtype, head_dim, mask, softcap, dropout=dropout)
    for arch, dtype, head_dim, mask, softcap, dropout in itertools.product(
        FAMILY_ARCHS["sm90"], DTYPES, SM90_BWD_HEAD_DIMS, MASKS, (False, True), (False, True)
    ):
        if archs is None or arch in archs:
            yield KernelSpec("bwd", "sm90", arch, dtype, head_dim, mask, softcap, dropout=dropout)


def bwd_row_specs(archs: Iterable[str] | None = None) -> Iterator[KernelSpec]:
    for arch, direction, dtype in itertools.product(FAMILY_ARCHS[BASE_FAMILY], ("bwd_pre", "bwd_post"), DTYPES):
        if archs is None or arch in archs:
            yield KernelSpec(direction, BASE_FAMILY, arch, dtype)


_BY_DIRECTION = {
    "fwd": fwd_specs,
    "bwd": bwd_specs,
    "append": append_specs,
    "combine": combine_specs,
    "bwd_pre": lambda archs: (s for s in bwd_row_specs(archs) if s.direction == "bwd_pre"),
    "bwd_post": lambda archs: (s for s in bwd_row_specs(archs) if s.direction == "bwd_post"),
}


def all_specs(
    directions: Iterable[str] | None = None, archs: Iterable[str] | None = None
) -> list[KernelSpec]:
    """Every valid spec, sorted, optionally filtered by direction and arch."""
    archs = tuple(archs) if archs is not None else None
    specs: list[KernelSpec] = []
    for direction, generate in _BY_DIRECTION.items():
        if directions is None or direction in directions:
            specs.extend(generate(archs))
    return sorted(specs)


def is_in_matrix(spec: KernelSpec) -> bool:
    return spec in _MATRIX_SET


@functools.lru_cache(maxsize=4096)
def find_instance(*fields, **switches) -> KernelSpec | None:
    """The instance of these KernelSpec fields, if the matrix holds it; None if not, also for
    switch values that no instance can take (KernelSpec refuses them). How the runtime asks which
    instances exist instead of restating the rules above."""
    try:
        spec = KernelSpec(*fields, **switches)
    except ValueError:
        return None
    return spec if spec in _MATRIX_SET else None


_MATRIX_SET = frozenset(all_specs())
