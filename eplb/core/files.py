"""Bounded reads: every input eplb reads is measured against one limit before it is loaded.

The limit is `EPLB_MAX_INPUT_BYTES` (environment; default 1 GiB, accepts `4GiB`, `500MB` or
plain bytes): for `.npy` / `.npz` the shapes their headers declare (an array is never
allocated from a header that asks for more), for archives the declared uncompressed sizes (and
every member's CRC is checked, which torch's reader skips), for JSON what parsing it costs,
counted from the text before it is parsed (JSON_*_BYTES per value: a value costs far more as a
Python object than as text), for YAML the nodes the loader composes, aliases expanded
(YAML_NODE_BYTES each), counted as they are composed. JSON deeper than MAX_JSON_DEPTH is
refused before it is parsed. tests/unit/test_memory.py checks the charges against the peak
memory of real reads. Atomic writes are eplb/core/outputs.py.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import zipfile
import zlib
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np

from eplb.errors import EplbError, reason, shown

MAX_INPUT_ENV = "EPLB_MAX_INPUT_BYTES"
DEFAULT_MAX_INPUT_BYTES = 2**30
JSON_NUMBER_BYTES = 128
"""Memory one JSON number (or true/false/null) costs once parsed and converted to arrays: its
Python object and list slot (up to 36 bytes) plus the numpy copies a reader makes of it; the
measured worst, floats read as a trace, is 109 (tests/unit/test_memory.py)."""
JSON_STRING_BYTES = 192
"""Memory one JSON string costs beyond its text (a str object, measured 183 for '"a"')."""
JSON_CONTAINER_BYTES = 160
"""Memory one JSON array or object costs (measured 157 for '[1]' read as a trace)."""
ARRAY_COPY_BYTES = 8
"""Each element of a .npy / .npz array counts its bytes twice (the array, a temporary of its
kind) plus this many more: the int64 or float64 copy a reader makes (Trace holds int64)."""
TENSOR_BYTES = 64
"""Each element of a torch tensor counts this many bytes: torch's storage, the float64 numpy
copy, the checks' temporaries and the int64 copies (tests/unit/test_memory.py measured 45-57
for an int64 trace, depending on the torch and numpy builds)."""
YAML_NODE_BYTES = 1536
"""Memory one YAML node costs while PyYAML composes and constructs it (the node, its two marks,
the Python value; measured up to 1.1 KB)."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of JSON arrays / objects accepted (eplb's own files nest at most 6 deep)."""

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


def as_path(path, what: str) -> Path:
    """`path` (text or os.PathLike) as a Path; anything else (None, a number, a list) is refused by name."""
    if isinstance(path, (bytes, bytearray)):
        path = os.fsdecode(bytes(path))
    if not isinstance(path, (str, os.PathLike)):
        raise EplbError(f"{what} must be a file path (str or pathlib.Path), got {type(path).__name__} "
                        f"{shown(path)}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text.strip() or "\0" in text:  # Path("") is ".", the folder
        raise EplbError(f"{what} {shown(text)} is not a file name: give a path")
    return Path(text)


def input_file(path: str | Path, what: str) -> Path:
    """`path` as a Path if it is a readable regular file; otherwise an error saying what it is."""
    p = as_path(path, what)
    if p.is_dir():
        raise EplbError(f"{what} {str(p)!r} is a folder, not a file")
    if not p.exists():
        raise EplbError(f"{what} {str(p)!r} does not exist")
    if not p.is_file():
        raise EplbError(f"{what} {str(p)!r} is not a regular file")
    return p


def read_bytes(path: str | Path, what: str) -> bytes:
    """The bytes of a file, after checking its size against the input limit (what parsing them
    costs is checked by the parser: parse_json, parse_yaml)."""
    p = input_file(path, what)

    def check(size: int) -> None:
        check_input_size(p, size, f"{format_size(size)} of data")

    size = p.stat().st_size
    check(size)
    limit = max_input_bytes()
    with open(p, "rb") as f:
        # The size stat() gave, plus one byte to see whether the file grew since; then at most one
        # byte past the limit (read(limit) would allocate the limit, not the file).
        data = f.read(size + 1)
        if len(data) > size:
            data += f.read(max(limit + 1 - len(data), 0))
    check(len(data))
    return data


# JSON ------------------------------------------------------------------------------------------

_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


class JsonScan(NamedTuple):
    depth: int
    """Deepest nesting of arrays and objects."""
    cost: int
    """Bytes in memory parsing the text costs, estimated from what it holds (JSON_*_BYTES)."""


_BOM = b"\xef\xbb\xbf"
_WIDE_BOMS = (b"\xff\xfe", b"\xfe\xff")
"""How UTF-16 and UTF-32 text starts (UTF-32-LE begins like UTF-16-LE; UTF-32-BE files are not seen)."""


def json_scan(data: bytes) -> JsonScan:
    """Nesting depth and parsing cost of JSON text, from one pass over it in chunks (brackets,
    commas and colons inside strings do not count). Vectorised, with no object per string: a
    regex substitution made two per string, 230 bytes each for a file of short strings."""
    depth = best = 0
    counts = np.zeros(256, dtype=np.int64)
    quotes = inside = 0
    in_string = 0  # 1 while the scan is inside a string, carried from chunk to chunk
    slashes = 0  # backslashes that ended the previous chunk (a quote after an odd run is escaped)
    chunk = 1 << 22
    for start in range(0, len(data), chunk):  # chunks keep the temporaries small in memory
        raw = np.frombuffer(data, dtype=np.uint8, count=min(chunk, len(data) - start), offset=start)
        n = raw.size
        slash = raw == 0x5C
        quote = raw == 0x22
        q_i = np.flatnonzero(quote)
        if q_i.size and (slashes or slash.any()):
            # Backslashes just before each quote: its index minus the last index that is not one.
            last_i = np.maximum.accumulate(np.where(slash, -1, np.arange(n, dtype=np.int32)))
            prev_i = np.where(q_i > 0, last_i[np.maximum(q_i - 1, 0)], 0)
            run_i = np.where(q_i > 0, q_i - 1 - prev_i, 0)
            run_i = np.where((q_i > 0) & (prev_i < 0), q_i + slashes, run_i)
            run_i = np.where(q_i == 0, slashes, run_i)
            quote[q_i[run_i % 2 == 1]] = False  # escaped: part of the string
            tail = n - 1 - int(last_i[-1])
            slashes = tail if last_i[-1] >= 0 else slashes + n
        else:
            slashes = 0 if not slash[-1:].any() else slashes + n
        # Inside a string from its opening quote up to, not including, its closing one.
        state = np.bitwise_xor.accumulate(quote.view(np.uint8)) ^ in_string
        in_string = int(state[-1])
        outside = (state == 0) & ~quote
        quotes += int(np.count_nonzero(quote))
        inside += n - int(np.count_nonzero(outside))
        body = raw[outside]
        counts += np.bincount(body, minlength=256)
        step = _OPEN[body]
        nz = step[step != 0].astype(np.int64)
        if nz.size:
            run = depth + np.cumsum(nz)
            best = max(best, int(run.max()))
            depth = int(run[-1])
    n_strings = (quotes + 1) // 2
    containers = int(counts[ord("[")] + counts[ord("{")])
    # Values (keys included) = 1 + commas + colons + non-empty containers; the strings and
    # containers among them are priced on their own.
    scalars = max(0, 1 + int(counts[ord(",")] + counts[ord(":")]) - n_strings)
    # Text that is not ASCII decodes to up to 4 bytes a character (one astral character makes
    # the whole str 4 bytes wide), and string contents become str objects of their own.
    wide = 1 if data.isascii() else 4
    cost = (len(data) * (1 + wide) + inside * wide + JSON_NUMBER_BYTES * scalars + JSON_STRING_BYTES * n_strings
            + JSON_CONTAINER_BYTES * containers)
    return JsonScan(best, cost)


def json_depth(data: bytes) -> int:
    """Deepest nesting of arrays and objects in JSON text (brackets inside strings do not count)."""
    return json_scan(data).depth


def parse_json(data: bytes, source: str) -> Any:
    """Parse JSON bytes (a UTF-8 byte-order mark is allowed), or raise EplbError naming `source`
    (too deep, too large to parse within the input limit, not UTF-8, not JSON)."""
    if data.startswith(_BOM):  # what some Windows editors write first; JSON's text is what follows
        data = data[len(_BOM):]
    if data[:2] in _WIDE_BOMS:  # json.loads would take it; every engine reads UTF-8 only
        raise EplbError(f"{source}: JSON saved as UTF-16 or UTF-32 (it starts with a byte-order mark of those): "
                        f"save it as UTF-8")
    scan = json_scan(data)
    if scan.depth > MAX_JSON_DEPTH:
        raise EplbError(f"{source}: JSON nested {scan.depth} levels deep, more than the {MAX_JSON_DEPTH} eplb "
                        f"reads (its files nest at most 6): not an eplb, SGLang or backtest file")
    check_input_size(source, scan.cost, f"parsing {format_size(len(data))} of JSON")
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
    return parse_json(read_bytes(path, what), str(path))


# YAML ------------------------------------------------------------------------------------------

@functools.cache
def _yaml_loader():
    """yaml.SafeLoader (plain data only) that counts the nodes it composes, aliases expanded."""
    import yaml

    class BoundedSafeLoader(yaml.SafeLoader):
        # An alias is one node in the file but its whole anchored value in what is read: 1 KB of
        # aliases of aliases ("billion laughs") describes 10**8 values. Each node's size with
        # its aliases expanded is counted as it is composed, so a document is refused before
        # its expansion is built, by anything (eplb's loops, an error message) that walks it.
        budget = 0
        source = ""

        def __init__(self, stream) -> None:
            super().__init__(stream)
            self._composed = 0
            self._expanded: dict[int, int] = {}

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                anchored = self.anchors.get(self.peek_event().anchor)
                if anchored is not None and id(anchored) not in self._expanded:
                    raise EplbError(f"{self.source}: a YAML alias refers to a value that contains it (a recursive "
                                    f"structure): not plain data; write the values out")
                return super().compose_node(parent, index)
            self._composed += 1
            if self._composed > self.budget:
                self._refuse(self._composed, "nodes")
            node = super().compose_node(parent, index)
            if isinstance(node, yaml.SequenceNode):
                size = 1 + sum(self._expanded[id(n)] for n in node.value)
            elif isinstance(node, yaml.MappingNode):
                size = 1 + sum(self._expanded[id(k)] + self._expanded[id(v)] for k, v in node.value)
            else:
                size = 1
            if size > self.budget:
                self._refuse(size, "values once its aliases are expanded")
            self._expanded[id(node)] = size
            return node

        def _refuse(self, n: int, what: str):
            raise EplbError(f"{self.source}: the YAML holds more than {self.budget:,} {what}, more than the input "
                            f"limit of {format_size(max_input_bytes())} allows ({YAML_NODE_BYTES} bytes each): "
                            f"eplb's and TensorRT-LLM's files hold a few thousand and no aliases; if the file is "
                            f"trusted, raise the limit with {MAX_INPUT_ENV}")

    return BoundedSafeLoader


def parse_yaml(data: bytes, source: str) -> Any:
    """Parse YAML bytes as plain data (yaml.safe_load's types: no tags that build objects), within
    the input limit: every node, aliases expanded, counts YAML_NODE_BYTES. Errors name `source`."""
    import yaml

    loader = _yaml_loader()
    # The decoded text is held beside the nodes (up to 4 bytes a character).
    budget = (max_input_bytes() - 5 * len(data)) // YAML_NODE_BYTES
    if budget < 1:
        check_input_size(source, 5 * len(data), f"parsing {format_size(len(data))} of YAML")
    bounded = type("Loader", (loader,), {"budget": budget, "source": source})
    try:
        return yaml.load(data, Loader=bounded)  # noqa: S506 (a SafeLoader subclass: plain data only)
    except yaml.YAMLError as exc:
        raise EplbError(f"{source}: not valid YAML ({reason(exc)})") from None
    except RecursionError:
        raise EplbError(f"{source}: YAML nested too deeply to parse") from None


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


def array_cost(shape, dtype) -> int:
    """Bytes reading an array of `shape` and `dtype` may take: 2x its own plus ARRAY_COPY_BYTES
    per element (a uint8 array becomes int64: its copy takes 8x the file)."""
    n = math.prod(int(s) for s in shape)
    return n * (2 * np.dtype(dtype).itemsize + ARRAY_COPY_BYTES)


def _npy_checked(header: NpyHeader, available: int, path, name: str) -> None:
    what = f"array {name} (shape {header.shape}, {header.dtype})" if name else \
        f"the array (shape {header.shape}, {header.dtype})"
    check_input_size(path, array_cost(header.shape, header.dtype), f"reading {what}")
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


def check_archive(path: str | Path, what: str, *, crc: bool = True) -> list[str]:
    """Check a zip archive (a torch .pt) against the limit by its declared uncompressed size and,
    with `crc`, every member's CRC-32 (read in bounded chunks); returns its member names.

    torch's reader checks no CRC: one flipped byte in a tensor's data loads as another number."""
    p = Path(path)
    try:
        with zipfile.ZipFile(p) as z:
            infos = z.infolist()
            total = sum(i.file_size for i in infos)
            check_input_size(p, total, f"{what} ({format_size(total)} uncompressed)")
            if crc:
                for info in infos:
                    with z.open(info) as f:  # zipfile compares the CRC when a member's end is read
                        while f.read(1 << 20):
                            pass
    except EplbError:
        raise
    except ZIP_ERRORS as exc:
        raise EplbError(f"{p}: starts like a zip archive but is corrupt ({reason(exc)}): the file is damaged; "
                        f"copy or write it again") from None
    return [i.filename for i in infos]
