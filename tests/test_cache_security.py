"""CPU tier: the cache never follows links, refuses folders other users can plant kernels in, and
turns every fault below its top folder into a warning and a cubin used from memory.

Faults are injected (os.mkdir, os.open, fcntl.flock raising) where the test runs as root, whom
permission bits do not stop; test_cache_unprivileged.py runs the real thing as another user.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat
from pathlib import Path

import filelock
import pytest

from flashgen.generator import cache, nvrtc

from test_cache import OTHER_SPEC, SPEC, entry_files, entry_of, fallback_dir, nvrtc_unloadable

NOBODY = 65534


def get_from_memory(fake_nvrtc, caplog, spec=SPEC) -> str:
    """get_cubin gives the compiled cubin despite the fault; returns the warnings' text."""
    compiles = len(fake_nvrtc.calls)
    with caplog.at_level(logging.WARNING, logger="flashgen"):
        assert cache.get_cubin(spec) == fake_nvrtc.cubin(spec.uri)
    assert "using the compiled kernel from memory" in caplog.text
    cache.get_cubin(spec)  # kept for the rest of the process: no compile per call
    assert fake_nvrtc.calls[compiles:] == [spec.uri]
    return caplog.text


def another_users(path: Path, monkeypatch) -> None:
    """Make ``path`` another user's: chown as root, else pretend to be someone else."""
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    else:
        me = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: me + 1)


# --- Links are never followed --------------------------------------------------------------------

def test_a_linked_cubin_is_not_followed_and_is_replaced_not_written_through(fake_nvrtc, fresh_cache, caplog, tmp_path):
    cache.get_cubin(SPEC)
    entry = entry_of(SPEC)
    valid = tmp_path / "valid.cubin"  # a valid frame of this very kernel, elsewhere
    entry.path(".cubin").rename(valid)
    entry.path(".cubin").symlink_to(valid)
    cache._cubins.clear()
    with caplog.at_level(logging.WARNING, logger="flashgen"):
        cache.get_cubin(SPEC)
    assert "Too many levels of symbolic links" in caplog.text
    assert fake_nvrtc.calls == [SPEC.uri, SPEC.uri]
    assert not entry.path(".cubin").is_symlink()  # os.replace put a file in the link's place
    assert cache._read_cubin(entry) == fake_nvrtc.cubin(SPEC.uri)


def test_a_linked_lock_never_truncates_its_target(fake_nvrtc, fresh_cache, caplog, tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    entry = entry_of(SPEC)
    entry.directory.mkdir(parents=True)
    entry.path(".lock").symlink_to(target)
    text = get_from_memory(fake_nvrtc, caplog)
    assert "Too many levels of symbolic links" in text and str(entry.path(".lock")) in text
    assert target.read_bytes() == b"keep me" and entry.path(".lock").is_symlink()
    assert not entry_files(fresh_cache, ".cubin")


def test_a_linked_kernel_folder_is_not_followed(fake_nvrtc, fresh_cache, caplog, tmp_path):
    cache.get_cubin(SPEC)
    entry = entry_of(SPEC)
    elsewhere = tmp_path / "elsewhere"
    entry.directory.rename(elsewhere)
    entry.directory.symlink_to(elsewhere, target_is_directory=True)
    before = sorted(p.name for p in elsewhere.iterdir())
    cache._cubins.clear()
    text = get_from_memory(fake_nvrtc, caplog)
    assert "a link, which flashgen does not follow" in text
    assert sorted(p.name for p in elsewhere.iterdir()) == before


def test_a_linked_metadata_file_is_not_read(fake_nvrtc, fresh_cache, monkeypatch, tmp_path):
    """Without NVRTC the metadata proposes versions: a linked one is skipped."""
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (12, 8))
    cache.get_cubin(SPEC)
    entry = entry_of(SPEC)
    real = tmp_path / "meta.json"
    entry.path(".json").rename(real)
    entry.path(".json").symlink_to(real)
    cache._cubins.clear()
    nvrtc_unloadable(monkeypatch)
    monkeypatch.setenv("FLASHGEN_DISABLE_JIT", "1")
    with pytest.raises(cache.JitDisabledError):
        cache.get_cubin(SPEC)
    assert json.loads(real.read_text())["nvrtc_version"] == [12, 8]


def test_a_fifo_entry_does_not_hang(fake_nvrtc, fresh_cache, caplog):
    entry = entry_of(SPEC)
    entry.directory.mkdir(parents=True)
    os.mkfifo(entry.path(".cubin"))
    with caplog.at_level(logging.WARNING, logger="flashgen"):
        assert cache._read_cubin(entry) is None
    assert "not a regular file" in caplog.text


def test_filelock_behaviour_on_an_existing_lock_file(tmp_path):
    """Why the entry lock opens its file itself on POSIX: filelock 3.x opens an existing lock file
    with O_TRUNC (so a linked .lock empties its target); 4.x keeps it and refuses links.  This
    records what the installed filelock does, so a change is seen."""
    existing, target, link = tmp_path / "existing.lock", tmp_path / "target", tmp_path / "link.lock"
    existing.write_bytes(b"holder")
    target.write_bytes(b"keep me")
    link.symlink_to(target)
    with filelock.FileLock(existing):
        pass
    if int(filelock.__version__.split(".")[0]) >= 4:
        assert existing.read_bytes() == b"holder"
        with pytest.raises(OSError) as info:
            with filelock.FileLock(link, timeout=1):
                pass
        assert info.value.errno == errno.ELOOP and target.read_bytes() == b"keep me"
    else:
        assert existing.read_bytes() == b""
    # flashgen's own lock keeps an existing lock file's content and refuses a link.
    existing.write_bytes(b"holder")
    with cache._file_lock(existing):
        pass
    assert existing.read_bytes() == b"holder"
    with pytest.raises(OSError) as info:
        with cache._file_lock(link):
            pass
    assert info.value.errno == errno.ELOOP and target.read_bytes() == b"keep me"


def test_posix_entries_are_not_locked_with_filelock(fake_nvrtc, fresh_cache, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("filelock used on POSIX")

    monkeypatch.setattr(filelock, "FileLock", refuse)
    assert cache.get_cubin(SPEC) == fake_nvrtc.cubin(SPEC.uri)
    assert entry_of(SPEC).path(".lock").is_file()


# --- Folders other users can write are refused ---------------------------------------------------

def plant_valid_entry(fake_nvrtc, directory: Path, spec=SPEC) -> None:
    """A valid entry of ``spec`` in ``directory`` (as another user with write access could make)."""
    entry = entry_of(spec, root=directory)
    entry.directory.mkdir(parents=True, exist_ok=True)
    entry.path(".cubin").write_bytes(cache._frame(entry, b"\x7fELF planted"))


@pytest.mark.parametrize("kind", ["world-writable", "another-users"])
def test_a_cache_folder_others_can_write_is_refused(fake_nvrtc, fresh_cache, temp_root, monkeypatch, caplog, kind):
    plant_valid_entry(fake_nvrtc, fresh_cache)
    if kind == "world-writable":
        fresh_cache.chmod(0o777)
        reason = "writable by every user"
    else:
        another_users(fresh_cache, monkeypatch)
        reason = "owned by another user"
    assert reason in cache.untrusted_reason(fresh_cache)
    with caplog.at_level(logging.WARNING, logger="flashgen"):
        assert cache.get_cubin(SPEC) == fake_nvrtc.cubin(SPEC.uri)  # compiled, not the planted one
        cache.get_cubin(OTHER_SPEC)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0] and str(fallback_dir(temp_root)) in warnings[0]
    assert len(entry_files(fallback_dir(temp_root), ".cubin")) == 2
    assert len(entry_files(fresh_cache, ".cubin")) == 1  # nothing written there


def test_a_sticky_world_writable_cache_folder_is_used(fake_nvrtc, fresh_cache, caplog):
    fresh_cache.mkdir(parents=True)
    fresh_cache.chmod(0o1777)  # like /tmp: others may add folders, not replace this user's
    with caplog.at_level(logging.WARNING, logger="flashgen"):
        cache.get_cubin(SPEC)
    assert not caplog.records and entry_files(fresh_cache, ".cubin")


def test_a_linked_cache_folder_is_followed(fake_nvrtc, fresh_cache, tmp_path, monkeypatch):
    """Only below the top: FLASHGEN_CACHE_DIR (or ~/.cache) may well be a link to scratch space."""
    real = tmp_path / "scratch"
    real.mkdir()
    fresh_cache.symlink_to(real, target_is_directory=True)
    cache.get_cubin(SPEC)
    assert entry_files(real, ".cubin")


@pytest.mark.parametrize("kind", ["world-writable", "another-users"])
def test_a_kernel_folder_others_can_write_is_not_read_nor_written(fake_nvrtc, fresh_cache, monkeypatch, caplog, kind):
    plant_valid_entry(fake_nvrtc, fresh_cache)
    directory = entry_of(SPEC).directory
    if kind == "world-writable":
        directory.chmod(0o1777)  # the sticky bit does not stop anyone adding an entry
        reason = "writable by every user"
    else:
        another_users(directory, monkeypatch)
        reason = "owned by another user"
    text = get_from_memory(fake_nvrtc, caplog)
    assert reason in text and str(directory) in text


# --- Every fault below the top folder is a warning and a cubin from memory -----------------------

def fail_on(monkeypatch, function: str, suffix: str, error: int) -> None:
    """Make os.<function> raise OSError(error) for paths ending in ``suffix``."""
    real = getattr(os, function)

    def failing(path, *args, **kwargs):
        if str(path).endswith(suffix):
            raise OSError(error, os.strerror(error), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, function, failing)


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EMFILE, errno.EACCES, errno.EROFS])
def test_kernel_folder_creation_faults(fake_nvrtc, fresh_cache, monkeypatch, caplog, error):
    fail_on(monkeypatch, "mkdir", SPEC.uri, error)
    assert os.strerror(error) in get_from_memory(fake_nvrtc, caplog)


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EMFILE, errno.EACCES, errno.ELOOP])
def test_lock_creation_faults(fake_nvrtc, fresh_cache, monkeypatch, caplog, error):
    fail_on(monkeypatch, "open", ".lock", error)
    assert os.strerror(error) in get_from_memory(fake_nvrtc, caplog)
    assert not entry_files(fresh_cache, ".cubin")


def test_a_file_system_without_locks(fake_nvrtc, fresh_cache, monkeypatch, caplog):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(cache.fcntl, "flock", no_locks)
    assert os.strerror(errno.ENOLCK) in get_from_memory(fake_nvrtc, caplog)


def test_a_kernel_folder_that_is_a_file(fake_nvrtc, fresh_cache, caplog):
    fresh_cache.mkdir()
    (fresh_cache / SPEC.uri).write_text("not a folder")
    assert "not a folder" in get_from_memory(fake_nvrtc, caplog)


def test_a_lock_that_is_a_folder(fake_nvrtc, fresh_cache, caplog):
    entry = entry_of(SPEC)
    entry.path(".lock").mkdir(parents=True)
    get_from_memory(fake_nvrtc, caplog)


def test_a_build_reports_a_fault_as_a_failure(fake_nvrtc, fresh_cache, monkeypatch):
    fail_on(monkeypatch, "open", ".lock", errno.ENOSPC)
    (result,) = cache.build([SPEC], jobs=1)
    assert result.error is not None and "No space left on device" in result.error
    assert result.cache_dir is None


# --- cache clear ---------------------------------------------------------------------------------

def test_clear_reports_a_linked_entry_and_leaves_its_target(fake_nvrtc, fresh_cache, tmp_path):
    cache.get_cubin(SPEC)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.cubin").write_bytes(b"keep")
    link = fresh_cache / OTHER_SPEC.uri
    link.symlink_to(elsewhere, target_is_directory=True)
    result = cache.clear_cache()
    assert result.removed == 1
    assert result.failed == [(link, "a link, which flashgen does not follow")]
    assert (elsewhere / "precious.cubin").read_bytes() == b"keep" and link.is_symlink()


def test_clear_removes_links_inside_an_entry_without_following_them(fake_nvrtc, fresh_cache, tmp_path):
    cache.get_cubin(SPEC)
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    (entry_of(SPEC).directory / "x.cu").symlink_to(target)
    assert cache.clear_cache() == cache.ClearResult(removed=1, failed=[])
    assert target.read_bytes() == b"keep"


def test_clear_reports_what_it_could_not_remove(fake_nvrtc, fresh_cache, monkeypatch):
    cache.get_cubin(SPEC)
    cache.get_cubin(OTHER_SPEC)
    stuck = entry_of(SPEC).path(".cubin")
    fail_on(monkeypatch, "unlink", stuck.name, errno.EACCES)  # rmtree unlinks by name in its folder
    result = cache.clear_cache()
    assert result.removed == 1 and stuck.exists()
    paths = [path for path, _ in result.failed]
    assert any(p.name == stuck.name for p in paths), result.failed
    assert all("Permission denied" in reason or "not empty" in reason for _, reason in result.failed)


def test_entries_are_files_and_folders_only_their_owner_writes(fake_nvrtc, fresh_cache):
    cache.get_cubin(SPEC)
    for path in [entry_of(SPEC).directory, *entry_of(SPEC).directory.iterdir()]:
        mode = os.lstat(path).st_mode
        assert not stat.S_ISLNK(mode) and not mode & (stat.S_IWGRP | stat.S_IWOTH), path
