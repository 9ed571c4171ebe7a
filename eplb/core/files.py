"""Atomic writes and bounded reads: the two rules every file eplb touches goes through.

Writes (`atomic_output`, `write_bytes`, `write_text`): the data goes to a temporary file in the
target's own folder, is flushed and fsynced, then renamed over the target, and the folder is
fsynced. A reader sees the old file or the new one, never a mix; on any failure (no space,
permission, an exception in the caller's code) the temporary file is removed and the previous
file is byte-for-byte intact. On Linux the temporary file is unnamed (O_TMPFILE) until the
moment before the rename, so even a writer killed with SIGKILL leaves nothing behind; where the
file system cannot do that, it is a hidden `.NAME.XXXXXXXX.eplb-tmp` next to the target.
A target that exists and is not a regular file (/dev/null, a FIFO) is written in place.

Reads: every input is measured against one limit before it is loaded, `EPLB_MAX_INPUT_BYTES`
(environment; default 1 GiB, accepts `4GiB`, `500MB` or plain bytes): for `.npy` / `.npz`
the shapes their headers declare (an array is never allocated from a header that asks for
more), for archives the declared uncompressed sizes, for text (JSON, YAML) the file size x
TEXT_EXPANSION (what parsing costs in memory). JSON deeper than MAX_JSON_DEPTH is refused
before it is parsed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import stat
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np

from eplb.errors import EplbError, reason

MAX_INPUT_ENV = "EPLB_MAX_INPUT_BYTES"
DEFAULT_MAX_INPUT_BYTES = 2**30
TEXT_EXPANSION = 8
"""Text inputs count this many times their size: parsed JSON numbers take 4-8x their text."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of JSON arrays / objects accepted (eplb's own files nest at most 6 deep)."""
TEMP_SUFFIX = ".eplb-tmp"

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)


# Sizes and the input limit ----------------------------------------------------------------------

def parse_size(text: str) -> int:
    """Bytes from '2000000000', '2e9', '4GiB' or '500MB' (raises ValueError otherwise)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def format_size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} bytes"


def max_input_bytes() -> int:
    """The input limit in bytes: EPLB_MAX_INPUT_BYTES, or 1 GiB."""
    text = os.environ.get(MAX_INPUT_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_INPUT_BYTES
    try:
        limit = parse_size(text)
    except (ValueError, OverflowError):  # "lots", or 1e400 (an infinite float)
        limit = 0
    if limit < 1:
        raise EplbError(f"{MAX_INPUT_ENV}={text!r} is not a size: give bytes (2000000000) or a number with "
                        f"a unit (4GiB, 500MB)")
    return limit


def check_input_size(path: str | Path, nbytes: int, what: str) -> None:
    """Refuse to load `what` of `path` when it would take more than the input limit."""
    limit = max_input_bytes()
    if nbytes > limit:
        raise EplbError(f"{path}: {what} would take {format_size(nbytes)} in memory, more than the input limit "
                        f"of {format_size(limit)}: if the file is trusted and the memory is there, raise the "
                        f"limit with {MAX_INPUT_ENV}={_round_up(nbytes)}")


def _round_up(n: int) -> str:
    """A size at least n, in the units a person would type (3GiB, 700MiB)."""
    return f"{math.ceil(n / 2**30)}GiB" if n > 2**30 else f"{math.ceil(n / 2**20)}MiB"


def input_file(path: str | Path, what: str) -> Path:
    """`path` as a Path if it is a readable regular file; otherwise an error saying what it is."""
    p = Path(path)
    if p.is_dir():
        raise EplbError(f"{what} {str(p)!r} is a folder, not a file")
    if not p.exists():
        raise EplbError(f"{what} {str(p)!r} does not exist")
    if not p.is_file():
        raise EplbError(f"{what} {str(p)!r} is not a regular file")
    return p


def read_bytes(path: str | Path, what: str, *, text: bool = False) -> bytes:
    """The bytes of a file, after checking its size against the input limit (text counts
    TEXT_EXPANSION times its size)."""
    p = input_file(path, what)
    scale = TEXT_EXPANSION if text else 1

    def check(size: int) -> None:
        check_input_size(p, size * scale, f"parsing {format_size(size)} of text" if text else
                         f"{format_size(size)} of data")

    check(p.stat().st_size)
    with open(p, "rb") as f:  # at most one byte past the limit: a file may grow after stat()
        data = f.read(max_input_bytes() // scale + 1)
    check(len(data))
    return data


# JSON ------------------------------------------------------------------------------------------

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


def json_depth(data: bytes) -> int:
    """Deepest nesting of arrays and objects in JSON text (brackets inside strings do not count)."""
    body = _JSON_STRING.sub(b'""', data)
    depth = best = 0
    chunk = 1 << 22
    for start in range(0, len(body), chunk):  # chunks keep the running sum small in memory
        step = _OPEN[np.frombuffer(body, dtype=np.uint8, count=min(chunk, len(body) - start), offset=start)]
        nz = step[step != 0].astype(np.int64)
        if nz.size:
            run = depth + np.cumsum(nz)
            best = max(best, int(run.max()))
            depth = int(run[-1])
    return best


def parse_json(data: bytes, source: str) -> Any:
    """Parse JSON bytes, or raise EplbError naming `source` (too deep, not UTF-8, not JSON)."""
    depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise EplbError(f"{source}: JSON nested {depth} levels deep, more than the {MAX_JSON_DEPTH} eplb reads "
                        f"(its files nest at most 6): not an eplb, SGLang or backtest file")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise EplbError(f"{source}: not UTF-8 text, so not JSON ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise EplbError(f"{source}: JSON nested too deeply to parse") from None
    except ValueError as exc:  # JSONDecodeError, and integers longer than Python converts
        raise EplbError(f"{source}: not valid JSON ({exc})") from None


def read_json(path: str | Path, what: str) -> Any:
    """Parse a JSON file within the input limit; errors name the file (`what` says what it should be)."""
    return parse_json(read_bytes(path, what, text=True), str(path))


# .npy / .npz headers ---------------------------------------------------------------------------

ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, OSError, EOFError, RuntimeError,
              NotImplementedError, ValueError, OverflowError)
"""What zipfile and zlib raise on damaged, encrypted or oddly compressed archives."""


class NpyHeader(NamedTuple):
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    """Bytes of data the header declares."""
    offset: int
    """Bytes of magic + header before the data."""


def read_npy_header(f: IO[bytes], source: str) -> NpyHeader:
    """The header of the .npy stream `f` (positioned at its start), without reading the data."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(f)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = fmt.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except Exception as exc:  # numpy parses the header text with ast and tokenize: anything can come out
        raise EplbError(f"{source}: not a readable .npy array header ({reason(exc)})") from None
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise EplbError(f"{source}: holds Python objects (dtype {dtype}), which cannot be read without pickle; "
                        f"eplb never unpickles files (pickle can run code): store plain numbers")
    nbytes = math.prod(int(s) for s in shape) * dtype.itemsize
    return NpyHeader(tuple(int(s) for s in shape), dtype, nbytes, f.tell())


def _npy_checked(header: NpyHeader, available: int, path, name: str) -> None:
    what = f"array {name} (shape {header.shape}, {header.dtype})" if name else \
        f"the array (shape {header.shape}, {header.dtype})"
    check_input_size(path, header.nbytes, what)
    if available < header.nbytes:
        raise EplbError(f"{path}: truncated: {what} needs {header.nbytes:,} bytes of data, the file holds "
                        f"{max(available, 0):,}")


def check_npy(path: str | Path) -> NpyHeader:
    """Check a .npy file's header before loading: no objects, within the limit, not truncated."""
    p = Path(path)
    with open(p, "rb") as f:
        header = read_npy_header(f, str(p))
    _npy_checked(header, p.stat().st_size - header.offset, p, "")
    return header


def check_npz(path: str | Path) -> dict[str, NpyHeader]:
    """Check every array of a .npz before loading: declared uncompressed sizes (the zip's and
    each header's) within the limit, no objects, none truncated. Returns name -> header."""
    p = Path(path)
    out = {}
    try:
        with zipfile.ZipFile(p) as z:
            infos = z.infolist()
            total = sum(i.file_size for i in infos)
            check_input_size(p, total, f"{len(infos)} archive member(s) ({format_size(total)} uncompressed)")
            for info in infos:
                if not info.filename.endswith(".npy"):
                    continue
                name = info.filename[:-4]
                with z.open(info) as f:
                    header = read_npy_header(f, f"{p} [{name}]")
                _npy_checked(header, info.file_size - header.offset, p, repr(name))
                out[name] = header
    except EplbError:
        raise
    except ZIP_ERRORS as exc:
        raise EplbError(f"{p}: a corrupt or unreadable zip archive ({reason(exc)})") from None
    return out


def load_npz(path: str | Path, what: str = ".npz file") -> dict[str, np.ndarray]:
    """Every array of a .npz, checked first (`check_npz`), never unpickled; a damaged archive
    is an EplbError naming the file as `what`."""
    check_npz(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except ZIP_ERRORS as exc:
        raise EplbError(f"{path}: not a readable {what} ({reason(exc)})") from None


def check_archive(path: str | Path, what: str) -> list[str]:
    """Check a zip archive (a torch .pt) against the limit by its declared uncompressed size;
    returns its member names."""
    p = Path(path)
    try:
        with zipfile.ZipFile(p) as z:
            infos = z.infolist()
    except ZIP_ERRORS as exc:
        raise EplbError(f"{p}: starts like a zip archive but is corrupt ({reason(exc)})") from None
    total = sum(i.file_size for i in infos)
    check_input_size(p, total, f"{what} ({format_size(total)} uncompressed)")
    return [i.filename for i in infos]


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


@contextlib.contextmanager
def atomic_output(path: str | Path, *, what: str = "the output") -> Iterator[IO[bytes]]:
    """A binary file to write `path` through: it replaces `path` only when the block ends without
    an error, fully written and synced. Errors are EplbError naming the file."""
    target = Path(path)
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
        # A device or a FIFO (/dev/null, a pipe): nothing to replace, nothing to keep.
        try:
            with open(final, "wb") as f:
                yield f
        except OSError as exc:
            raise _fail(target, what, exc, False) from None
        return
    if st is not None and not os.access(final, os.W_OK):
        raise EplbError(f"cannot write {what} to {str(target)!r}: the file is read-only (Permission denied); "
                        f"make it writable or give another name")
    folder = final.parent
    if not folder.is_dir():
        raise EplbError(f"cannot write {what} to {str(target)!r}: folder {str(folder)!r} does not exist")
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
