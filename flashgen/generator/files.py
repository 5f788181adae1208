"""Writing files that other users may read (the kernel cache, a failed compile's sources), without
following links: folders 0755 and files 0644 whatever the umask, written by atomic replace, in
folders checked to be real and this user's (or root's)."""
from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

FILE_MODE = 0o644
DIR_MODE = 0o755


def owner_problem(st: os.stat_result) -> str | None:
    """Why a folder with this stat may hold code another user planted, as far as its owner goes."""
    if hasattr(os, "geteuid") and st.st_uid not in (os.geteuid(), 0):
        return f"owned by another user (uid {st.st_uid})"
    return None


def check_dir(directory: Path) -> None:
    """Raise OSError unless ``directory`` is a real folder (not a link) owned by this user or root
    and not writable by every user (the sticky bit would not stop anyone adding an entry).  Group
    write is accepted: folders made under a umask of 002 (user-private groups) have it."""
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, "a link, which flashgen does not follow", str(directory))
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(directory))
    problem = owner_problem(st) or ("writable by every user" if st.st_mode & stat.S_IWOTH else None)
    if problem is not None:
        raise PermissionError(errno.EPERM, problem, str(directory))


def make_dir(directory: Path, mode: int = DIR_MODE) -> None:
    """Create ``directory`` (not its parents) with exactly ``mode``, whatever the umask."""
    try:
        os.mkdir(directory, mode)
    except FileExistsError:
        return
    os.chmod(directory, mode)


def atomic_write(path: Path, data: bytes) -> None:
    """Readers see the old file or the whole new one: write a temp file in the same directory (same
    file system, so the rename is atomic), then os.replace, which replaces a link at ``path`` and
    never writes through it.  mkstemp creates the temp file with O_EXCL and O_NOFOLLOW; the mode is
    then set to 0644 so other users can load a cache one user built."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            if hasattr(os, "fchmod"):
                os.fchmod(file.fileno(), FILE_MODE)
            file.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
