"""CPU tier: `flashgen build --archive` and `flashgen cache import`: a deterministic archive with a
manifest, imported through the cache's safe writers after every member is checked, and loaded with
FLASHGEN_DISABLE_JIT=1 where NVRTC cannot be loaded."""
from __future__ import annotations

import hashlib
import io
import json
import stat
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashgen.cli import cli
from flashgen.generator import cache, matrix, nvrtc

from test_cache import nvrtc_unloadable

SMALL = "bwd_pre_sm80_"  # the two bwd_pre instances for sm_80: the smallest, quick to compile


def run(*args: str, expect: int = 0):
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == expect, (result.output, result.exception)
    return result


def small_specs():
    return [s for s in matrix.all_specs(archs=["sm_80"]) if SMALL in s.uri]


def build_archive(path: Path) -> str:
    return run("build", "--arch", "sm_80", "--filter", SMALL, "-j", "1", "--archive", str(path)).output


def members(path: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(path) as tar:
        return [(m, tar.extractfile(m).read() if m.isfile() else b"") for m in tar.getmembers()]


def rewrite(path: Path, items: list[tuple[tarfile.TarInfo, bytes]]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in items:
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)


def into_empty_cache(monkeypatch, tmp_path) -> Path:
    """Another machine: an empty cache folder, nothing in memory."""
    target = tmp_path / "deployed"
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(target))
    monkeypatch.setattr(cache, "_cubins", {})
    return target


def test_archive_holds_a_manifest_and_the_framed_cubins(fake_nvrtc, fresh_cache, tmp_path):
    archive = tmp_path / "kernels.tar.gz"
    output = build_archive(archive)
    assert f"wrote {archive}: 2 kernels" in output
    items = members(archive)
    manifest = json.loads(items[0][1])
    assert items[0][0].name == "manifest.json"
    assert {k: manifest[k] for k in ("format", "schema", "cache_schema", "archs")} == {
        "format": "flashgen-cubin-archive", "schema": 1, "cache_schema": cache.SCHEMA_VERSION, "archs": ["sm_80"]}
    assert manifest["nvrtc_version"] == list(nvrtc.nvrtc_version())
    assert "cuda_headers_major" in manifest
    assert [e["uri"] for e in manifest["entries"]] == sorted(s.uri for s in small_specs())
    stored = {m.name: data for m, data in items[1:]}
    for entry in manifest["entries"]:
        name = f"{entry['uri']}/{entry['key']}"
        cubin = stored[f"{name}.cubin"]
        assert cubin == (fresh_cache / f"{name}.cubin").read_bytes()  # framed, as stored
        assert entry["sha256"] == hashlib.sha256(cubin).hexdigest()
        assert json.loads(stored[f"{name}.json"])["nvrtc_version"] == entry["nvrtc_version"]
    assert all(m.mtime == 0 and m.mode == 0o644 and m.uid == 0 for m, _ in items)
    assert stat.S_IMODE(archive.stat().st_mode) == 0o644

    again = tmp_path / "again.tar.gz"
    build_archive(again)  # all cached now
    assert again.read_bytes() == archive.read_bytes()  # deterministic


def test_import_then_load_without_nvrtc(fake_nvrtc, fresh_cache, tmp_path, monkeypatch):
    archive = tmp_path / "kernels.tar.gz"
    build_archive(archive)
    target = into_empty_cache(monkeypatch, tmp_path)
    assert f"imported 2 kernels from {archive} into {target}" in run("cache", "import", str(archive)).output
    for path in target.rglob("*"):
        assert stat.S_IMODE(path.lstat().st_mode) == (0o755 if path.is_dir() else 0o644), path
    nvrtc_unloadable(monkeypatch)
    monkeypatch.setenv("FLASHGEN_DISABLE_JIT", "1")
    for spec in small_specs():
        assert cache.get_cubin(spec) == fake_nvrtc.cubin(spec.uri)
    assert len(fake_nvrtc.calls) == 2  # the two compiles of the build; none after the import


def test_import_replaces_a_planted_link_and_never_writes_through_it(fake_nvrtc, fresh_cache, tmp_path, monkeypatch):
    archive = tmp_path / "kernels.tar.gz"
    build_archive(archive)
    manifest = json.loads(members(archive)[0][1])
    target = into_empty_cache(monkeypatch, tmp_path)
    entry = manifest["entries"][0]
    (target / entry["uri"]).mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    planted = target / entry["uri"] / f"{entry['key']}.cubin"
    planted.symlink_to(victim)
    run("cache", "import", str(archive))
    assert victim.read_bytes() == b"keep" and not planted.is_symlink()


def test_import_refuses_a_linked_entry_folder(fake_nvrtc, fresh_cache, tmp_path, monkeypatch):
    archive = tmp_path / "kernels.tar.gz"
    build_archive(archive)
    uri = json.loads(members(archive)[0][1])["entries"][0]["uri"]
    target = into_empty_cache(monkeypatch, tmp_path)
    target.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (target / uri).symlink_to(elsewhere, target_is_directory=True)
    assert "a link" in run("cache", "import", str(archive), expect=1).output
    assert list(elsewhere.iterdir()) == []


def _evil(name: str, kind=tarfile.REGTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    if kind == tarfile.SYMTYPE:
        info.linkname = "/etc/passwd"
    return info


@pytest.mark.parametrize("name, kind, reason", [
    ("../escaped.cubin", tarfile.REGTYPE, "absolute path or '..'"),
    ("flash_x/../../escaped.cubin", tarfile.REGTYPE, "absolute path or '..'"),
    ("/tmp/flashgen-escaped.cubin", tarfile.REGTYPE, "absolute path or '..'"),
    ("flash_x/link.cubin", tarfile.SYMTYPE, "not a regular file"),
    ("flash_x/extra.cubin", tarfile.REGTYPE, "not in the manifest"),
])
def test_import_refuses_odd_members_before_writing_anything(fake_nvrtc, fresh_cache, tmp_path, monkeypatch,
                                                             name, kind, reason):
    archive = tmp_path / "kernels.tar.gz"
    build_archive(archive)
    rewrite(archive, [*members(archive), (_evil(name, kind), b"planted")])
    target = into_empty_cache(monkeypatch, tmp_path / "deep" / "er")
    output = run("cache", "import", str(archive), expect=1).output
    assert reason in output and repr(name) in output
    assert not target.exists()
    assert not (tmp_path / "deep" / "escaped.cubin").exists() and not Path("/tmp/flashgen-escaped.cubin").exists()


def test_import_checks_each_cubins_digest_and_frame(fake_nvrtc, fresh_cache, tmp_path, monkeypatch):
    archive = tmp_path / "kernels.tar.gz"
    build_archive(archive)
    items = members(archive)
    manifest = json.loads(items[0][1])
    first, second = manifest["entries"]
    cubins = {m.name: i for i, (m, _) in enumerate(items) if m.name.endswith(".cubin")}
    first_at = cubins[f"{first['uri']}/{first['key']}.cubin"]
    second_at = cubins[f"{second['uri']}/{second['key']}.cubin"]
    target = into_empty_cache(monkeypatch, tmp_path)

    damaged = list(items)
    damaged[first_at] = (items[first_at][0], items[first_at][1][:-1] + b"X")
    rewrite(archive, damaged)
    assert "does not match its sha256 in the manifest" in run("cache", "import", str(archive), expect=1).output

    # The second kernel's valid cubin under the first one's name, with a digest to match: the frame
    # says whose it is.
    swapped = list(items)
    swapped[first_at] = (items[first_at][0], items[second_at][1])
    first["sha256"] = hashlib.sha256(items[second_at][1]).hexdigest()
    swapped[0] = (items[0][0], json.dumps(manifest).encode())
    rewrite(archive, swapped)
    output = run("cache", "import", str(archive), expect=1).output
    assert f"is framed for {second['uri']}" in output
    assert not list(target.rglob("*.cubin"))


def test_import_refuses_what_is_not_an_archive(fresh_cache, tmp_path):
    bogus = tmp_path / "bogus.tar.gz"
    bogus.write_bytes(b"not a tar")
    assert "is not a flashgen archive" in run("cache", "import", str(bogus), expect=1).output


def test_no_archive_when_a_build_fails(monkeypatch, fresh_cache, tmp_path):
    def failing_compile(source, name, arch, headers, options, source_path=None):
        raise nvrtc.CompileError(name, "error", source_path, options)

    monkeypatch.setattr(nvrtc, "compile_with_log", failing_compile)
    archive = tmp_path / "kernels.tar.gz"
    output = run("build", "--arch", "sm_80", "--filter", SMALL, "-j", "1", "--archive", str(archive), expect=1).output
    assert "no archive written" in output and not archive.exists()


def test_real_nvrtc_archive_deploys_without_nvrtc(fresh_cache, tmp_path, monkeypatch):
    """What a deployment does: CI builds with NVRTC and archives; the deployed machine imports the
    archive into an empty cache and, with FLASHGEN_DISABLE_JIT=1 and no loadable NVRTC, gets the
    very same cubins."""
    archive = tmp_path / "kernels.tar.gz"
    assert "2 kernels: 0 cached, 2 compiled, 0 failed" in build_archive(archive)
    built = {spec: cache.get_cubin(spec) for spec in small_specs()}
    assert all(cubin.startswith(b"\x7fELF") for cubin in built.values())

    into_empty_cache(monkeypatch, tmp_path)
    run("cache", "import", str(archive))
    nvrtc_unloadable(monkeypatch)
    monkeypatch.setattr(nvrtc, "compile_with_log", lambda *args, **kwargs: pytest.fail("compiled"))
    monkeypatch.setenv("FLASHGEN_DISABLE_JIT", "1")
    for spec, cubin in built.items():
        assert cache.get_cubin(spec) == cubin
