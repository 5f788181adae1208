"""CPU tier: the flashgen command, through click's test runner."""
from __future__ import annotations

import collections
import errno
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import flashgen
from flashgen import cli as cli_module
from flashgen import config
from flashgen.cli import MANIFEST, cli, example_specs
from flashgen.generator import cache, matrix, nvrtc, render
from flashgen.generator.nvrtc import CompileError

ONE_URI_FILTER = "sm80_hdim64_bf16_sm80"  # the plain bf16 d64 instance for sm_80 only


def run(*args: str, expect: int = 0):
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == expect, (result.output, result.exception)
    return result


def test_list():
    output = run("list").output.splitlines()
    assert output[0].split()[0] == "uri"
    specs = matrix.all_specs()
    assert output[-1] == f"{len(specs)} kernel instances, {len(matrix.compile_targets(specs))} cubins"
    assert output[0].split()[-1] == "cubin_arch"
    assert len(output) == len(matrix.all_specs()) + 2


def test_list_json_filtered():
    rows = json.loads(run("list", "--json", "--direction", "fwd", "--arch", "sm_80,sm_90a").output)
    specs = matrix.all_specs(directions=["fwd"], archs=["sm_80", "sm_90a"])
    assert [row["uri"] for row in rows] == [s.uri for s in specs]
    assert rows[0] == {"uri": specs[0].uri, **specs[0].to_dict(), "cubin_arch": specs[0].arch}


def test_list_rejects_an_unknown_arch():
    assert "sm_75" in run("list", "--arch", "sm_75", expect=2).output


def test_emit_then_check(tmp_path):
    out = tmp_path / "generated"
    run("emit", "--out", str(out))
    specs = matrix.all_specs()
    examples = example_specs(specs)
    files = {p.name for p in out.iterdir()}
    assert files == ({render.instance_filename(s) for s in examples}
                     | {render.PARAMS_HEADER, render.wgmma.HEADER, MANIFEST})
    assert {(s.direction, s.family) for s in examples} == {(s.direction, s.family) for s in specs}
    manifest = json.loads((out / MANIFEST).read_text())
    assert [m["uri"] for m in manifest] == sorted(s.uri for s in specs)
    assert manifest[0]["file"] == f"{manifest[0]['uri']}.cu"
    assert [m["cubin_arch"] for m in manifest] == [matrix.compile_target(s).arch for s in sorted(specs, key=lambda s: s.uri)]
    by_uri = {s.uri: s for s in specs}
    assert all(m["digest"] == hashlib.sha256(render.render_instance(by_uri[m["uri"]]).encode()).hexdigest()[:16]
               for m in manifest[:50])
    assert "up to date" in run("emit", "--out", str(out), "--check").output

    drifted = out / render.instance_filename(examples[0])
    drifted.write_text(drifted.read_text() + "// edited by hand\n")
    missing = out / render.PARAMS_HEADER
    missing.unlink()
    (out / "flash_fwd_old_instance.cu").write_text("")
    output = run("emit", "--out", str(out), "--check", expect=1).output
    assert f"drifted: {drifted}" in output
    assert f"missing: {missing}" in output
    assert f"extra: {out / 'flash_fwd_old_instance.cu'}" in output

    output = run("emit", "--out", str(out)).output
    assert "2 written, 1 stale removed" in output
    run("emit", "--out", str(out), "--check")


def test_emit_filter_writes_any_instance_in_full(tmp_path):
    """Every instance's source on demand; the manifest's digest is that source's."""
    out = tmp_path / "src"
    wanted = [s for s in matrix.all_specs() if "hdim96_fp16_local_softcap" in s.uri]
    assert wanted
    run("emit", "--out", str(out), "--filter", "hdim96_fp16_local_softcap")
    for spec in wanted:
        text = (out / render.instance_filename(spec)).read_text()
        assert text == render.render_instance(spec)
        entry = next(m for m in json.loads((out / MANIFEST).read_text()) if m["uri"] == spec.uri)
        assert entry["digest"] == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert "up to date" in run("emit", "--out", str(out), "--filter", "hdim96_fp16_local_softcap", "--check").output
    # Without the filter they are extra, and a plain emit removes them.
    assert f"extra: {out / render.instance_filename(wanted[0])}" in run("emit", "--out", str(out), "--check", expect=1).output
    assert f"{len(wanted)} stale removed" in run("emit", "--out", str(out)).output


def test_build_compiles_then_finds_cached(fake_nvrtc):
    output = run("build", "--direction", "fwd", "--arch", "sm_80", "--filter", ONE_URI_FILTER, "-j", "1").output
    assert "1 kernels: 0 cached, 1 compiled, 0 failed" in output
    assert fake_nvrtc.calls == ["flash_fwd_sm80_hdim64_bf16_sm80"]
    output = run("build", "--direction", "fwd", "--arch", "sm_80", "--filter", ONE_URI_FILTER, "-j", "1").output
    assert "1 kernels: 1 cached, 0 compiled, 0 failed" in output


def test_build_reports_slower_code_without_failing(fake_nvrtc):
    """ptxas's "Potential Performance Loss" on a compile: the kernel is built (exit 0) and named."""
    loss = "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized"
    fake_nvrtc.log = loss + "\n"
    output = run("build", "--direction", "fwd", "--arch", "sm_80", "--filter", ONE_URI_FILTER, "-j", "1").output
    assert "1 kernels: 0 cached, 1 compiled, 0 failed" in output
    assert f"SLOWER CODE flash_fwd_sm80_hdim64_bf16_sm80: {loss}" in output


def test_build_failure_exits_nonzero_with_uri_and_log(monkeypatch, fresh_cache):
    def failing_compile(source, name, arch, headers, options, source_path=None):
        raise CompileError(name, "kernel.cu(3): error: expected a ';'", source_path, options)

    monkeypatch.setattr("flashgen.generator.nvrtc.compile_with_log", failing_compile)
    result = run(
        "build", "--direction", "fwd", "--arch", "sm_90a", "--filter", "sm80_hdim128_fp16_causal_sm90a", "-j", "1", expect=1
    )
    assert "1 failed" in result.output
    assert "FAILED flash_fwd_sm80_hdim128_fp16_causal_sm90a" in result.output
    assert "expected a ';'" in result.output


def test_build_with_nothing_to_build():
    result = run("build", "--arch", "sm_80", "--filter", "nothing-like-this", expect=2)
    assert "no instance" in result.output


def test_cache_info_and_clear(fake_nvrtc, fresh_cache):
    run("build", "--direction", "fwd", "--arch", "sm_80", "--filter", ONE_URI_FILTER, "-j", "1")
    output = run("cache", "info").output
    assert str(fresh_cache) in output and "entries:   1" in output
    assert "removed 1 entries" in run("cache", "clear").output
    assert "entries:   0" in run("cache", "info").output


def test_doctor_runs_anywhere(fresh_cache):
    expect = 0 if torch.cuda.is_available() else 1  # without a GPU it lists a fix
    output = run("doctor", expect=expect).output
    for label in ("python:", "torch:", "gpu:", "driver:", "nvrtc:", "cuda headers:", "cache:"):
        assert label in output
    assert f"{fresh_cache} (writable)" in output
    assert ("to fix:" in output) == bool(expect)


@pytest.fixture
def healthy_machine(monkeypatch, fresh_cache):
    """An H200 with a CUDA 13.5 driver, NVRTC 13.5 and its headers, as doctor sees them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200")
    monkeypatch.setattr(cli_module, "_driver_status", lambda: ("supports CUDA 13.5", (13, 5), None))
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (13, 5))
    monkeypatch.setattr(nvrtc, "cuda_include_dir", lambda: Path("/usr/local/cuda/include"))


def test_doctor_exits_zero_when_nothing_needs_fixing(healthy_machine):
    assert "everything flashgen needs was found" in run("doctor").output


@pytest.mark.parametrize(
    "nvrtc_version, bindings, driver, advice",
    [
        ((13, 0), 13, (12, 8), "NVRTC 13 and cuda-bindings 13 are newer than the driver's CUDA 12.8: "
                               "pip install 'flashgen[cu12]', or update the NVIDIA driver"),
        # NVRTC 12 alone is not enough: cuda-bindings 13 needs a CUDA 13 driver (R580).
        ((12, 9), 13, (12, 4), "cuda-bindings 13 is newer than the driver's CUDA 12.4: pip install 'flashgen[cu12]'"),
        ((13, 0), 12, (11, 8), "NVRTC 13 and cuda-bindings 12 are newer than the driver's CUDA 11.8: "
                               "update the NVIDIA driver (flashgen needs CUDA 12.0 or newer"),
        ((14, 0), 13, (13, 0), "NVRTC 14 is newer than the driver's CUDA 13.0: pip install 'flashgen[cu13]'"),
    ],
)
def test_doctor_advises_what_the_driver_supports(healthy_machine, monkeypatch, nvrtc_version, bindings, driver, advice):
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: nvrtc_version)
    monkeypatch.setattr(nvrtc, "bindings_major", lambda: bindings)
    monkeypatch.setattr(cli_module, "_driver_status", lambda: ("supports CUDA", driver, None))
    output = run("doctor", expect=1).output
    assert advice in output and "nvidia-cuda-nvrtc" not in output


@pytest.mark.parametrize(
    "nvrtc_version, bindings, driver",
    [((13, 5), 13, (13, 0)), ((12, 9), 12, (12, 4)), ((12, 9), 12, (13, 0))],
)
def test_doctor_compares_major_versions_only(healthy_machine, monkeypatch, nvrtc_version, bindings, driver):
    """CUDA minor-version compatibility: a cubin of NVRTC 13.5 loads on a CUDA 13.0 driver."""
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: nvrtc_version)
    monkeypatch.setattr(nvrtc, "bindings_major", lambda: bindings)
    monkeypatch.setattr(cli_module, "_driver_status", lambda: ("supports CUDA", driver, None))
    assert "everything flashgen needs was found" in run("doctor").output


def test_doctor_says_to_unset_a_forced_nvrtc_the_driver_cannot_load(healthy_machine, monkeypatch):
    monkeypatch.setenv("FLASHGEN_NVRTC", "13")
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(nvrtc, "bindings_major", lambda: 12)
    monkeypatch.setattr(nvrtc, "nvrtc_libraries", lambda: {13: Path("/w/cu13/lib/libnvrtc.so.13"),
                                                           12: Path("/w/cuda_nvrtc/lib/libnvrtc.so.12")})
    monkeypatch.setattr(cli_module, "_driver_status", lambda: ("supports CUDA", (12, 8), None))
    output = run("doctor", expect=1).output
    assert "unset FLASHGEN_NVRTC=13 (NVRTC 12 is installed)" in output
    assert "FLASHGEN_NVRTC=13," in output  # the settings row
    assert "nvrtc wheels:   13 (/w/cu13/lib/libnvrtc.so.13), 12 (/w/cuda_nvrtc/lib/libnvrtc.so.12)" in output


def test_doctor_shows_the_nvrtc_wheels_and_the_default_choice(healthy_machine, monkeypatch):
    monkeypatch.setattr(nvrtc, "nvrtc_libraries", lambda: {})
    output = run("doctor").output
    assert "nvrtc wheels:   none from the nvidia wheels" in output and "FLASHGEN_NVRTC=(auto)," in output


def test_doctor_without_nvrtc_gives_the_install_hint_once(healthy_machine, monkeypatch):
    def missing():
        raise nvrtc.NvrtcNotFoundError(OSError("libnvrtc.so.13: cannot open shared object file"))

    monkeypatch.setattr(nvrtc, "nvrtc_version", missing)
    output = run("doctor", expect=1).output
    assert "nvrtc:          not usable (OSError: libnvrtc.so.13: cannot open shared object file)" in output
    assert f"  - {nvrtc.INSTALL_NVRTC_HINT}" in output and output.count(nvrtc.INSTALL_NVRTC_HINT) == 1


def test_doctor_with_an_invalid_flashgen_nvrtc_lists_only_that(healthy_machine, monkeypatch):
    def reads_the_knob():  # as the first nvrtc_version() of a process does
        config.nvrtc_major()
        return 13, 5

    monkeypatch.setattr(nvrtc, "nvrtc_version", reads_the_knob)
    monkeypatch.setenv("FLASHGEN_NVRTC", "twelve")
    output = run("doctor", expect=1).output
    assert "nvrtc:          not loaded (FLASHGEN_NVRTC is invalid)" in output
    assert "FLASHGEN_NVRTC must be an NVRTC major version" in output
    assert nvrtc.INSTALL_NVRTC_HINT not in output


@pytest.mark.parametrize(
    "cuinit, expected",
    [(0, ("supports CUDA 12.4", (12, 4), None)),
     (100, ("supports CUDA 12.4, but cuInit failed: CUDA_ERROR_NO_DEVICE", (12, 4),
            "check the driver install and CUDA_VISIBLE_DEVICES"))],
)
def test_driver_status_reads_the_version_that_chooses_nvrtc(monkeypatch, cuinit, expected):
    from cuda.bindings import driver

    monkeypatch.setattr(nvrtc, "driver_cuda_version", lambda: (12, 4))
    monkeypatch.setattr(driver, "cuInit", lambda flags: (driver.CUresult(cuinit),))
    assert cli_module._driver_status() == expected
    monkeypatch.setattr(nvrtc, "driver_cuda_version", lambda: None)
    assert cli_module._driver_status()[:2] == ("no NVIDIA driver found", None)


def test_doctor_names_a_refused_cache(healthy_machine, fresh_cache):
    fresh_cache.mkdir()
    fresh_cache.chmod(0o777)
    output = run("doctor", expect=1).output
    assert f"{fresh_cache} (not used: writable by every user)" in output


def test_version(monkeypatch):
    assert run("--version").output == f"flashgen {importlib.metadata.version('flashgen')}\n"

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)  # run from a source tree
    assert run("--version").output == f"flashgen {flashgen.__version__}\n"


def test_build_fails_when_entries_land_in_the_fallback(fake_nvrtc, fresh_cache, temp_root, monkeypatch):
    real_probe = cache.unwritable_reason
    monkeypatch.setattr(cache, "unwritable_reason", lambda d: "read-only" if d == fresh_cache else real_probe(d))
    args = ("build", "--direction", "fwd", "--arch", "sm_80", "--filter", ONE_URI_FILTER, "-j", "1")
    fallback = temp_root / f"flashgen-{os.getuid()}"
    for summary in ("0 cached, 1 compiled", "1 cached, 0 compiled"):  # compiled there, then found there
        result = run(*args, expect=1)
        assert summary in result.output
        assert f"1 kernels are not in the cache {fresh_cache} but in {fallback}" in result.output


def test_build_fails_when_an_entry_cannot_be_stored(fake_nvrtc, fresh_cache, monkeypatch):
    real_open = os.open

    def no_lock(path, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_lock)
    result = run("build", "--direction", "fwd", "--arch", "sm_80", "--filter", ONE_URI_FILTER, "-j", "1", expect=1)
    assert "1 failed" in result.output and "Too many open files" in result.output


def test_cache_clear_reports_what_it_could_not_remove(fake_nvrtc, fresh_cache, tmp_path):
    run("build", "--direction", "fwd", "--arch", "sm_80", "--filter", ONE_URI_FILTER, "-j", "1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (fresh_cache / "flash_fwd_linked").symlink_to(elsewhere, target_is_directory=True)
    result = run("cache", "clear", expect=1)
    assert "removed 1 entries" in result.output
    assert f"could not remove {fresh_cache / 'flash_fwd_linked'}: a link" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-GPU path of demo")
def test_demo_without_gpu_compiles_and_says_so(fake_nvrtc):
    output = run("demo", "-j", "1").output
    # bf16, two head dims, no mask and causal: the sm80 family for sm_80 and sm_90a, and on sm_90a
    # the sm90 forward too.
    families = collections.Counter((uri.split("_")[2], uri.rsplit("_", 1)[1]) for uri in fake_nvrtc.calls)
    assert families == {("sm80", "sm80"): 4, ("sm80", "sm90a"): 4, ("sm90", "sm90a"): 4}
    assert "No NVIDIA GPU found" in output and "none was run" in output
