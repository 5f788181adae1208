"""CPU tier, slow (marker ``matrix``): NVRTC compiles every forward instance for the targets CI
checks, Ampere (sm_80) and Hopper (sm_90a).  Needs no GPU.

The cubins that serve the selected instances (their compile targets, each once) are built in
parallel into the session's cache (with a progress line every 5% or 30 s on the terminal); each test
then reports its own instance, and get_cubin reads the cubin that serves it back through the normal
path.  (tests/test_spec_matrix.py checks, without compiling, that every instance served by another's
cubin renders the same program.)
"""
from __future__ import annotations

import contextlib
import os

import pytest

from flashgen.cli import ProgressLines
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
    # The build takes long (about 40 minutes on 2 cores): progress lines through the terminal
    # reporter, with output capturing suspended for each line (the reporter writes to the captured
    # file descriptor otherwise); none without the reporter (e.g. -p no:terminal).
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")

    def write_line(line: str) -> None:
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            reporter.write_line(line)

    targets = matrix.compile_targets(selected)
    progress = None
    if reporter is not None and targets:
        write_line(f"compiling the {len(targets)} cubins of {len(selected)} matrix instances with NVRTC")
        progress = ProgressLines(len(targets), write_line, label="matrix compile", interval=30.0)
    results = {}  # by compile target
    for result in cache.build(targets, jobs=os.cpu_count() or 1):
        results[result.spec] = result
        if progress is not None:
            progress.update()
    return results


@pytest.mark.matrix
@pytest.mark.parametrize("spec", matrix.all_specs(archs=CI_ARCHS), ids=lambda s: s.uri)
def test_instance_compiles(spec: KernelSpec, matrix_build):
    target = matrix.compile_target(spec)
    result = matrix_build[target]
    assert result.error is None, result.error
    # ptxas's "Potential Performance Loss" (e.g. C7512: every wgmma serialized for want of
    # registers) compiles a kernel several times slower than its code: a template change that
    # causes it fails here, before any GPU run.
    assert not result.performance_losses, result.performance_losses
    cubin = cache.get_cubin(target)
    assert cubin.startswith(b"\x7fELF")
    assert target.kernel_name.encode() in cubin  # the extern "C" entry the runtime looks up
