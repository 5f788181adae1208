"""CPU tier: the cache across users and processes, in subprocesses.

Another user: CI runs as root, whom permission bits do not stop, so these tests run the cache in a
child that drops to ``nobody`` (65534) when started as root (after its imports: the interpreter may
live where nobody cannot read, as under /root/.pyenv).  Started as another user they run as that
user, with the other user's part played by read-only modes.  They skip only when the child cannot
change user.

Build workers: a killed `flashgen build` must not leave its worker processes compiling.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from flashgen.generator import cache

from test_cache import REPO_ROOT, SPEC, entry_files, entry_of

NOBODY = 65534
AS_ROOT = os.geteuid() == 0
CANNOT_DROP = 77  # the child's exit status when it cannot become nobody

# argv: mode (get | clear), NVRTC version as JSON or "missing".  Prints the cubin (get) or runs
# `flashgen cache clear` (clear); the log goes to stderr.
_CHILD = r"""
import json, logging, os, sys
from flashgen import cli
from flashgen.generator import cache, nvrtc, render
from flashgen.generator.spec import KernelSpec

mode, version = sys.argv[1:3]
spec = KernelSpec("fwd", "sm80", "sm_80", "bf16", 64)
render.render_instance(spec), render.header_sources()  # load the templates before dropping to nobody
if os.geteuid() == 0:
    try:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    except OSError as exc:
        print(f"cannot become nobody: {exc}", file=sys.stderr)
        sys.exit(77)

def missing():
    raise nvrtc.NvrtcNotFoundError(OSError("libnvrtc.so: cannot open shared object file"))

nvrtc.nvrtc_version = missing if version == "missing" else lambda: tuple(json.loads(version))
nvrtc.compile_with_log = lambda source, name, *args, **kwargs: (b"\x7fELF" + name.encode() * 3, "")
logging.basicConfig(format="%(levelname)s %(message)s")
if mode == "clear":
    cli.cli.main(["cache", "clear"], prog_name="flashgen")
print(json.dumps({"uid": os.geteuid(), "cubin": cache.get_cubin(spec).decode()}))
"""


@pytest.fixture
def shared_tmp():
    """A folder under /tmp that nobody can reach (pytest's tmp_path is private to its user), with
    a home and a temp folder of the child's own."""
    base = Path(tempfile.mkdtemp(prefix="flashgen-test-", dir="/tmp" if Path("/tmp").is_dir() else None))
    base.chmod(0o755)
    for name in ("home", "tmp"):
        (base / name).mkdir()
        if AS_ROOT:
            os.chown(base / name, NOBODY, NOBODY)
    yield base
    for folder, _, _ in os.walk(base):  # read-only folders of the non-root variant
        os.chmod(folder, 0o755)
    shutil.rmtree(base)


def run_child(shared_tmp: Path, cache_dir: Path, mode: str = "get", version: str = "[12, 8]", **env):
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHGEN_")}
    child_env.update(
        PYTHONPATH=str(REPO_ROOT), PYTHONDONTWRITEBYTECODE="1", HOME=str(shared_tmp / "home"),
        TMPDIR=str(shared_tmp / "tmp"), FLASHGEN_CACHE_DIR=str(cache_dir), **env,
    )
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, version], cwd=shared_tmp, env=child_env,
        capture_output=True, text=True, timeout=120,
    )
    if result.returncode == CANNOT_DROP:
        pytest.skip(result.stderr.strip())
    return result


def child_output(result) -> dict:
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout.splitlines()[-1])
    assert output["uid"] == (NOBODY if AS_ROOT else os.geteuid())
    assert output["cubin"].encode() == b"\x7fELF" + SPEC.uri.encode() * 3
    return output


def owned_by_the_other(path: Path, mode: int) -> None:
    """Played by root when the child is nobody, else by read-only modes on the child's own files."""
    path.chmod(mode if AS_ROOT else mode & ~0o222)


def test_a_cache_prebuilt_by_root_loads_for_another_user_without_nvrtc(fake_nvrtc, shared_tmp, monkeypatch):
    prebuilt = shared_tmp / "prebuilt"
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(prebuilt))
    old = os.umask(0o077)  # a strict umask while building: the cache still ends up readable
    try:
        cache.get_cubin(SPEC)
    finally:
        os.umask(old)
    result = run_child(shared_tmp, prebuilt, version="missing", FLASHGEN_DISABLE_JIT="1")
    child_output(result)
    assert "WARNING" not in result.stderr, result.stderr


@pytest.mark.parametrize("whose", ["kernel-folder", "lock"])
def test_another_users_kernel_folder_or_lock_is_a_warning_and_a_fallback(fake_nvrtc, shared_tmp, monkeypatch, whose):
    shared = shared_tmp / "shared"
    shared.mkdir()
    entry = entry_of(SPEC, root=shared, version=(12, 8))  # the child's NVRTC version
    entry.directory.mkdir()
    if whose == "lock":
        entry.path(".lock").write_bytes(b"")
        owned_by_the_other(entry.path(".lock"), 0o644)
        give = [shared, entry.directory]
    else:
        owned_by_the_other(entry.directory, 0o755)
        give = [shared]
    if AS_ROOT:
        for path in give:
            os.chown(path, NOBODY, NOBODY)
    result = run_child(shared_tmp, shared)
    child_output(result)
    assert "using the compiled kernel from memory" in result.stderr
    assert "Permission denied" in result.stderr and str(entry.directory) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(not AS_ROOT, reason="giving a folder to another user needs root")
def test_a_cache_folder_of_another_user_is_refused(fake_nvrtc, shared_tmp):
    theirs = shared_tmp / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY - 1, NOBODY - 1)  # neither the child nor root
    result = run_child(shared_tmp, theirs)
    child_output(result)
    assert f"owned by another user (uid {NOBODY - 1})" in result.stderr
    assert entry_files(shared_tmp / "tmp" / f"flashgen-{NOBODY}", ".cubin")


def test_clearing_a_cache_of_another_user_reports_what_it_could_not_remove(fake_nvrtc, shared_tmp, monkeypatch):
    prebuilt = shared_tmp / "prebuilt"
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(prebuilt))
    cache.get_cubin(SPEC)
    owned_by_the_other(entry_of(SPEC).directory, 0o755)
    result = run_child(shared_tmp, prebuilt, mode="clear")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "removed 0 entries" in result.stdout
    assert f"could not remove {entry_of(SPEC).path('.cubin')}: [Errno 13] Permission denied" in result.stderr
    assert "Traceback" not in result.stderr
    assert entry_of(SPEC).path(".cubin").is_file()


# A parent whose two build workers each record their pid, then sleep; the parent prints nothing and
# sleeps too, until the test kills it.  argv: folder for the pid files, "prctl" or "watchdog".
_BUILD_PARENT = r"""
import multiprocessing, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from flashgen.generator import cache

def watchdog_only(parent_pid):
    cache._set_parent_death_signal = lambda: False
    cache._worker_init(parent_pid, {})

def work(folder):
    Path(folder, str(os.getpid())).touch()
    time.sleep(300)

if __name__ == "__main__":
    folder, how = sys.argv[1:3]
    if how == "prctl":
        executor = cache._build_executor(2, {})
    else:
        executor = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=watchdog_only, initargs=(os.getpid(),))
    for _ in range(2):
        executor.submit(work, folder)
    time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie is dead
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
@pytest.mark.parametrize("how", ["prctl", "watchdog"])
def test_build_workers_die_with_their_parent(tmp_path, how):
    script, pids_dir = tmp_path / "parent.py", tmp_path / "pids"
    script.write_text(_BUILD_PARENT)
    pids_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    parent = subprocess.Popen([sys.executable, str(script), str(pids_dir), how], env=env,
                              stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2:
            assert parent.poll() is None, parent.communicate()[1]
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.1)
            pids = [int(p.name) for p in pids_dir.iterdir()]
        parent.send_signal(signal.SIGKILL)  # no cleanup of any kind runs in the parent
        parent.wait(timeout=30)
        deadline = time.monotonic() + 20  # the watchdog looks once a second
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if _alive(pid)]
    finally:
        for pid in [parent.pid, *pids]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        parent.stderr.close()
