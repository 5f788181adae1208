"""CPU tier: each distinct kernel is compiled once.  An sm_86 instance that renders the same
program as its sm_80 twin runs the sm_80 cubin (matrix.compile_target): the build compiles it once,
archives carry it once, and an sm_86 device loads it."""
from __future__ import annotations

import dataclasses

import pytest

from flashgen.generator import matrix, render
from flashgen.generator.spec import KernelSpec
from flashgen.generator.tiles import fwd_tile

# Renders the same for sm_80 and sm_86 (the d128 forward tile fits 99 KB of shared memory) ...
SHARED = KernelSpec("fwd", "sm80", "sm_86", "bf16", 128, "causal")
# ... and not (sm_86's d256 tile is smaller).
OWN = KernelSpec("fwd", "sm80", "sm_86", "bf16", 256, "causal")


def twin(spec: KernelSpec, arch: str) -> KernelSpec:
    return dataclasses.replace(spec, arch=arch)


def renders_the_same(spec: KernelSpec, other: KernelSpec) -> bool:
    """``other``'s source with ``spec``'s name and spec line is ``spec``'s source."""
    source = render.render_instance(other).replace(render.spec_json(other), render.spec_json(spec))
    return source.replace(other.kernel_name, spec.kernel_name) == render.render_instance(spec)


@pytest.fixture
def fresh_targets():
    """compile_target decided anew (it is decided once per process), before and after the test."""
    matrix.compile_target.cache_clear()
    matrix._headers_agree.cache_clear()
    yield
    matrix.compile_target.cache_clear()
    matrix._headers_agree.cache_clear()


def test_identical_source_runs_the_sm80_cubin_and_a_different_one_its_own():
    assert fwd_tile("sm80", "sm_86", 128, "causal") == fwd_tile("sm80", "sm_80", 128, "causal")
    assert matrix.compile_target(SHARED) == twin(SHARED, "sm_80")
    assert fwd_tile("sm80", "sm_86", 256, "causal") != fwd_tile("sm80", "sm_80", 256, "causal")
    assert matrix.compile_target(OWN) == OWN
    # The row kernels take everything at run time: one cubin per major.
    append = KernelSpec("append", "sm80", "sm_86", "fp16")
    assert matrix.compile_target(append) == twin(append, "sm_80")


def test_every_instance_resolves_to_a_twin_that_renders_the_same():
    specs = matrix.all_specs()
    targets = {spec: matrix.compile_target(spec) for spec in specs}
    for spec, target in targets.items():
        assert target == twin(spec, target.arch) and matrix.is_in_matrix(target)
        assert matrix.compile_target(target) == target
        if spec.arch in ("sm_80", "sm_90a"):
            # Nothing below sm_80 in its major; sm_90a cubins run on 9.0 only, and serve no other arch.
            assert target == spec
        else:
            # The lowest arch of the major whose instance renders the same, else its own.
            assert target.arch == ("sm_80" if renders_the_same(spec, twin(spec, "sm_80")) else spec.arch), spec.uri
    assert sum(target != spec for spec, target in targets.items()) > 0
    assert matrix.compile_targets(specs) == list(dict.fromkeys(targets.values()))


@pytest.mark.parametrize("text, agree", [
    ("", True),
    ("#if __CUDA_ARCH__ >= 900\n#endif\n#if __CUDA_ARCH__ < 900\n#endif", True),
    ("#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)\n#endif\n#ifdef __CUDA_ARCH__\n#endif", True),
    ("#if __CUDA_ARCH__ >= 860\n#endif", False),
    ("#if __CUDA_ARCH__ == 800\n#endif", False),
    ("constexpr int kArch = __CUDA_ARCH__ / 10;", False),  # a use that reads the value
])
def test_arch_tests_agree(text, agree):
    assert matrix.arch_tests_agree(text, "sm_80", "sm_86") == agree


def test_a_header_that_tests_for_sm86_keeps_its_instances_apart(monkeypatch, fresh_targets):
    headers = render.header_sources()
    headers["common.cuh"] += "\n#if __CUDA_ARCH__ >= 860\n#endif\n"
    monkeypatch.setattr(render, "header_sources", lambda: headers)
    assert matrix.compile_target(SHARED) == SHARED
