"""CPU tier: each distinct kernel is compiled once.  An sm_86 instance that renders the same
program as its sm_80 twin runs the sm_80 cubin (matrix.compile_target): the build compiles it once,
archives carry it once, and an sm_86 device loads it."""
from __future__ import annotations

import dataclasses
import enum
import json
import tarfile

import pytest
from click.testing import CliRunner

from flashgen.cli import cli, shard_specs
from flashgen.generator import cache, matrix, render
from flashgen.generator.spec import KernelSpec
from flashgen.generator.tiles import fwd_tile
from flashgen.runtime import dispatch, launch

from test_cache import nvrtc_unloadable

# Renders the same for sm_80 and sm_86 (the d128 forward tile fits 99 KB of shared memory) ...
SHARED = KernelSpec("fwd", "sm80", "sm_86", "bf16", 128, "causal")
# ... and not (sm_86's d256 tile is smaller).
OWN = KernelSpec("fwd", "sm80", "sm_86", "bf16", 256, "causal")


def run(*args: str, expect: int = 0):
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == expect, (result.output, result.exception)
    return result


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


def test_build_compiles_each_cubin_once(fake_nvrtc):
    output = run("build", "--filter", "flash_append_", "-j", "1").output
    assert "2 of the 6 instances run the cubin of the same instance for a lower arch" in output
    assert "4 kernels for sm_80, sm_86, sm_90a" in output
    assert sorted(fake_nvrtc.calls) == sorted(
        f"flash_append_sm80_{dtype}_{arch}" for dtype in ("bf16", "fp16") for arch in ("sm80", "sm90a"))
    # An sm_86 build of the shared instances finds the sm_80 cubins: nothing to compile.
    assert "2 kernels: 2 cached, 0 compiled" in run("build", "--arch", "sm_86", "--filter", "flash_append_", "-j", "1").output
    assert len(fake_nvrtc.calls) == 4


def test_shards_split_the_cubins_and_compile_each_once(fake_nvrtc):
    selection = ["--arch", "sm_80,sm_86", "--filter", "hdim128_bf16_causal_", "-j", "1"]
    for index in (1, 2, 3):
        run("build", *selection, "--shard", f"{index}/3")
    instances = [s for s in matrix.all_specs(archs=["sm_80", "sm_86"]) if "hdim128_bf16_causal_" in s.uri]
    targets = matrix.compile_targets(instances)
    assert len(targets) < len(instances)
    assert sorted(fake_nvrtc.calls) == sorted(t.uri for t in targets)  # every cubin, none twice
    assert [t.uri for t in shard_specs(targets, 1, 3)] == sorted(fake_nvrtc.calls)[::3]


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0


class FakeDriver:
    """cuLibraryLoadData and cuLibraryGetKernel of cuda.bindings.driver: records what is loaded."""

    CUresult = CUresult

    def __init__(self):
        self.loaded: list[tuple[bytes, bytes]] = []  # (cubin, kernel name)
        self._cubins: dict[str, bytes] = {}

    def cuLibraryLoadData(self, cubin, *args):
        handle = f"library{len(self._cubins)}"
        self._cubins[handle] = bytes(cubin)
        return CUresult.CUDA_SUCCESS, handle

    def cuLibraryGetKernel(self, library, name):
        self.loaded.append((self._cubins[library], name))
        return CUresult.CUDA_SUCCESS, f"kernel {name.decode()}"


def plan_on_sm86(head_dim: int) -> dispatch.FwdPlan:
    return dispatch.plan_fwd(
        dtype="bf16", head_dim=head_dim, batch=2, seqlen_q=1024, seqlen_k=1024, nheads=8, nheads_k=8,
        causal=True, window_size=(-1, -1), softcap=0.0, pack_gqa=None,
        device=dispatch.DeviceInfo(capability=(8, 6), num_sms=84),
    )


def test_sm86_device_loads_the_sm80_cubin_from_an_imported_archive(fake_nvrtc, fresh_cache, tmp_path, monkeypatch):
    archive = tmp_path / "kernels.tar.gz"
    run("build", "--arch", "sm_86", "--direction", "fwd", "--filter", "bf16_causal_sm86", "-j", "1",
        "--archive", str(archive))
    instances = [s for s in matrix.all_specs(directions=["fwd"], archs=["sm_86"]) if "bf16_causal_sm86" in s.uri]
    assert SHARED in instances and OWN in instances
    with tarfile.open(archive) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())
    # One entry per cubin, for the arch it was compiled for; together they serve every instance.
    entries = {e["uri"]: e for e in manifest["entries"]}
    assert manifest["archs"] == ["sm_86"]
    assert sorted(entries) == sorted(fake_nvrtc.calls) == sorted(t.uri for t in matrix.compile_targets(instances))
    assert entries[twin(SHARED, "sm_80").uri]["arch"] == "sm_80"
    assert entries[twin(SHARED, "sm_80").uri]["serves"] == [SHARED.uri]
    assert entries[OWN.uri]["arch"] == "sm_86" and entries[OWN.uri]["serves"] == [OWN.uri]
    assert sorted(uri for e in entries.values() for uri in e["serves"]) == sorted(s.uri for s in instances)

    # The deployed machine: the archive imported into an empty cache, no NVRTC, an sm_86 GPU.
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "deployed"))
    monkeypatch.setenv("FLASHGEN_DISABLE_JIT", "1")
    monkeypatch.setattr(cache, "_cubins", {})
    nvrtc_unloadable(monkeypatch)
    run("cache", "import", str(archive))
    driver = FakeDriver()
    monkeypatch.setattr(launch, "_driver", driver)
    monkeypatch.setattr(launch, "_loaded", {})
    for head_dim, served_by in ((128, twin(SHARED, "sm_80")), (256, OWN)):
        plan = plan_on_sm86(head_dim)
        assert plan.spec == (SHARED if head_dim == 128 else OWN)
        kernel = launch.get_kernel(plan.spec, plan.tile.smem_bytes(head_dim), plan.tile.num_threads)
        assert kernel.spec == served_by
        assert driver.loaded[-1] == (fake_nvrtc.cubin(served_by.uri), served_by.kernel_name.encode())
    assert launch.get_kernel(SHARED, 0, 0) is launch.get_kernel(twin(SHARED, "sm_80"), 0, 0)
    assert len(driver.loaded) == 2  # each cubin loaded once
