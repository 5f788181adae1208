"""CPU tier, slow (marker ``matrix``): NVRTC compiles every forward instance for the targets CI
checks, Ampere (sm_80) and Hopper (sm_90a).  Needs no GPU.

The selected instances are built once, in parallel, into the session's cache; each test then
reports its own instance, and get_cubin reads the cubin back through the normal path.
"""
from __future__ import annotations

import os

import pytest

from flashgen.generator import cache, matrix
from flashgen.generator.spec import KernelSpec

CI_ARCHS = ("sm_80", "sm_90a")


@pytest.fixture(scope="session")
def matrix_build(request: pytest.FixtureRequest) -> dict[KernelSpec, cache.BuildResult]:
    # Only the instances this run selected (e.g. with -k), all cores at once.
    selected = [
        item.callspec.params["spec"]
        for item in request.session.items
        if item.get_closest_marker("matrix") and hasattr(item, "callspec")
    ]
    return {r.spec: r for r in cache.build(selected, jobs=os.cpu_count() or 1)}


@pytest.mark.matrix
@pytest.mark.parametrize("spec", matrix.all_specs(archs=CI_ARCHS), ids=lambda s: s.uri)
def test_instance_compiles(spec: KernelSpec, matrix_build):
    result = matrix_build[spec]
    assert result.error is None, result.error
    cubin = cache.get_cubin(spec)
    assert cubin.startswith(b"\x7fELF")
    assert spec.kernel_name.encode() in cubin  # the extern "C" entry the runtime looks up
