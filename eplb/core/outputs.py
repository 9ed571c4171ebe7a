"""Atomic writes: every file eplb writes goes through `atomic_output` (`write_bytes`, `write_text`).

The data goes to a temporary file in the target's own folder, is flushed and fsynced, then
renamed over the target, and the folder is fsynced. A reader sees the old file or the new one,
never a mix; on any failure (no space, permission, an exception in the caller's code) the
temporary file is removed and the previous file is byte-for-byte intact. On Linux the temporary
file is unnamed (O_TMPFILE) until the moment before the rename, so even a writer killed with
SIGKILL leaves nothing behind; where the file system cannot do that, it is a hidden
`.NAME.XXXXXXXX.eplb-tmp` next to the target. A target that exists and is not a regular file
(/dev/null, a FIFO) is written in place. Bounded reads are eplb/core/files.py.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from eplb.core.files import as_path
from eplb.errors import EplbError

TEMP_SUFFIX = ".eplb-tmp"

# Paths ----------------------------------------------------------------------------------------

def same_file(a: str | Path, b: str | Path) -> bool:
    """True when two paths name one file (hard links and symlinks included)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


# Atomic writes --------------------------------------------------------------------------------

def _fail(path, what: str, exc: OSError, existed: bool) -> EplbError:
    reason = exc.strerror or str(exc)
    kept = f"the previous {Path(path).name} is unchanged" if existed else "nothing was written"
    return EplbError(f"cannot write {what} to {str(path)!r}: {reason} ({kept})")


def _open_temp(dir_fd: int, name: str) -> tuple[int, str | None]:
    """A new file for the data: unnamed (O_TMPFILE, name None) where the system can link it into
    the folder later, else a hidden named one."""
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile and os.path.isdir("/proc/self/fd"):
        try:
            return os.open(".", tmpfile | os.O_WRONLY, 0o666, dir_fd=dir_fd), None
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise
    for _ in range(100):
        temp = f".{name[:200]}.{secrets.token_hex(4)}{TEMP_SUFFIX}"  # within NAME_MAX (255)
        try:
            return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=dir_fd), temp
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, "no free temporary file name")


def _link_temp(fd: int, dir_fd: int, name: str) -> str:
    """Give the unnamed file `fd` a temporary name in the folder (the rename needs one)."""
    for _ in range(100):
        temp = f".{name[:200]}.{secrets.token_hex(4)}{TEMP_SUFFIX}"  # within NAME_MAX (255)
        try:
            os.link(f"/proc/self/fd/{fd}", temp, dst_dir_fd=dir_fd, follow_symlinks=True)
            return temp
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, "no free temporary file name")


def _fsync_dir(dir_fd: int) -> None:
    try:
        os.fsync(dir_fd)
    except OSError as exc:  # some file systems cannot sync a folder; the rename is done either way
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise


def _target(path, what: str) -> tuple[Path, Path, os.stat_result | None]:
    """(the path, the file it names through symlinks, its stat or None when new), once the
    target is known to be writable the way atomic_output writes it; otherwise an EplbError."""
    target = as_path(path, f"the path for {what}")
    final = Path(os.path.realpath(target))  # a symlink keeps pointing at the file it names
    try:
        st = os.stat(final)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise _fail(target, what, exc, False) from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise EplbError(f"cannot write {what} to {str(target)!r}: it is a folder; give a file name")
    if st is not None and not stat.S_ISREG(st.st_mode):
        return target, final, st  # a device or a FIFO is written in place
    if st is not None and not os.access(final, os.W_OK):
        # access() also says no for an immutable file (chattr +i), which root cannot replace either.
        raise EplbError(f"cannot write {what} to {str(target)!r}: the file is read-only or immutable (Permission "
                        f"denied); make it writable or give another name")
    folder = final.parent
    if not folder.is_dir():
        via = f" (where the symlink {str(target)!r} points)" if final != Path(os.path.abspath(target)) else ""
        raise EplbError(f"cannot write {what} to {str(target)!r}: folder {str(folder)!r}{via} does not exist; "
                        f"give a path in an existing, writable folder")
    if not os.access(folder, os.W_OK):
        raise EplbError(f"cannot write {what} to {str(target)!r}: folder {str(folder)!r} is not writable "
                        f"(Permission denied); give a path in an existing, writable folder")
    return target, final, st


def is_special_target(path) -> bool:
    """True when `path` names an existing file that is not a regular one (/dev/null, a FIFO):
    written in place, whatever its name says."""
    try:
        st = os.stat(path)
    except (OSError, ValueError, TypeError):
        return False
    return not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode)


def check_writable(path, what: str) -> None:
    """Refuse, before any work, an output atomic_output would refuse when it writes: a folder, a
    read-only or immutable file, a missing or unwritable folder (a dangling symlink's included)."""
    _target(path, what)


@contextlib.contextmanager
def atomic_output(path: str | Path, *, what: str = "the output") -> Iterator[IO[bytes]]:
    """A binary file to write `path` through: it replaces `path` only when the block ends without
    an error, fully written and synced. Errors are EplbError naming the file."""
    target, final, st = _target(path, what)
    if st is not None and not stat.S_ISREG(st.st_mode):
        # A device or a FIFO (/dev/null, a pipe): nothing to replace, nothing to keep.
        try:
            with open(final, "wb") as f:
                yield f
        except OSError as exc:
            raise _fail(target, what, exc, False) from None
        return
    folder = final.parent
    existed = st is not None
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise _fail(target, what, exc, existed) from None
    temp = None
    f = None
    try:
        fd, temp = _open_temp(dir_fd, final.name)
        f = os.fdopen(fd, "wb")
        yield f
        f.flush()
        os.fsync(f.fileno())
        if st is not None:
            os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode))  # the new file keeps the old one's permissions
        if temp is None:
            temp = _link_temp(f.fileno(), dir_fd, final.name)
        f.close()
        os.replace(temp, final.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        temp = None
        _fsync_dir(dir_fd)
    except OSError as exc:
        raise _fail(target, what, exc, existed) from None
    finally:
        if f is not None and not f.closed:
            with contextlib.suppress(OSError):
                f.close()
        if temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
        os.close(dir_fd)


def write_bytes(path: str | Path, data: bytes, *, what: str = "the output") -> Path:
    """Write `data` to `path` atomically (see atomic_output); returns the path."""
    with atomic_output(path, what=what) as f:
        f.write(data)
    return Path(path)


def write_text(path: str | Path, text: str, *, what: str = "the output") -> Path:
    """Write UTF-8 `text` to `path` atomically (see atomic_output); returns the path."""
    return write_bytes(path, text.encode("utf-8"), what=what)
