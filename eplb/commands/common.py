"""Helpers shared by CLI commands: subcommand parsers with examples, JSON output, tables."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eplb.core.outputs import check_writable, is_special_target, same_file
from eplb.errors import EplbError

REDUNDANT_HELP = ("redundant slots in total (default: ceil(E / G) + 1 slots per GPU, i.e. one redundant slot per "
                  "GPU plus what rounds the E experts up to a multiple of the G GPUs)")
"""--redundant's help wherever the default sizing applies (eplb.Topology.for_experts)."""


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1, with a message naming the bad text."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def seed_int(text: str) -> int:
    """argparse type: a seed, a whole number in 0..2**63-1 (numpy refuses negative seeds)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= v < 2**63:
        raise argparse.ArgumentTypeError(f"a seed is a whole number in 0..2**63-1, got {v}")
    return v


def check_output_path(path: str, what: str, flag: str = "-o", inputs: Iterable[tuple[str, str]] = ()) -> None:
    """Refuse an output path that cannot be written, or that names one of the `inputs`
    ((flag or "TRACE", path) pairs), before the (maybe long) work that fills it."""
    if not path:
        raise EplbError(f"{flag} is empty: give a file name for {what}")
    for name, given in inputs:
        if given and same_file(path, given):
            # The input would be replaced by the output (a trace by a plan): refused before any work.
            raise EplbError(f"{flag} {path} names the input {name} {given}: writing {what} there would replace it; "
                            f"give {flag} another file name")
    p = Path(path)
    if p.is_dir():
        raise EplbError(f"cannot write {what} to {path!r}: it is a folder; give {flag} a file name inside it")
    # The folder the file lands in: a symlink's target's (a dangling one into a missing folder
    # failed only after the work).
    real = Path(os.path.realpath(p))
    parent = real.parent
    via = f" (where the symlink {path!r} points)" if real != Path(os.path.abspath(p)) else ""
    if not parent.is_dir():
        raise EplbError(f"cannot write {what} to {path!r}: folder {str(parent)!r}{via} does not exist (No such file "
                        f"or directory); give {flag} a path in an existing, writable folder")
    if not os.access(parent, os.W_OK):
        raise EplbError(f"cannot write {what} to {path!r}: folder {str(parent)!r}{via} is not writable (Permission "
                        f"denied); give {flag} a path in an existing, writable folder")
    check_writable(path, what)  # what atomic_output refuses when it writes: a read-only or immutable file


MAX_LAYER_ID = 2**62
"""Largest hidden-layer id typed on a command line (ids are int64, and every bound eplb checks fits)."""


@dataclass(frozen=True)
class LayerIds:
    """Hidden-layer ids as typed (`3-60`, `1,3,5`): increasing ranges, expanded only by `array()`,
    once their count is known to fit (`0-10000000000` is 10**10 ids: counted, never listed)."""

    ranges: tuple[tuple[int, int], ...]
    """(first, last) of each range, increasing and disjoint."""
    text: str

    def __len__(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.ranges)

    def array(self) -> np.ndarray:
        """The ids, int64 [len(self)]."""
        return np.concatenate([np.arange(lo, hi + 1, dtype=np.int64) for lo, hi in self.ranges])


def layer_id_list(text: str) -> LayerIds:
    """argparse type: hidden-layer ids as '3-60', '3..60', '1,3,5' or '0,3-5' (sorted, distinct)."""
    ranges: list[tuple[int, int]] = []
    try:
        for part in text.replace("..", "-").split(","):
            lo, sep, hi = part.strip().partition("-")
            a = int(lo)
            ranges.append((a, int(hi) if sep else a))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected hidden-layer ids like 3-60 or 1,3,5, got {text!r}") from None
    flat = [i for r in ranges for i in r]
    if min(flat) < 0 or any(b < a for a, b in ranges) or any(b[0] <= a[1] for a, b in zip(ranges, ranges[1:])):
        raise argparse.ArgumentTypeError(f"layer ids must be increasing and >= 0, got {text!r}")
    if max(flat) > MAX_LAYER_ID:
        raise argparse.ArgumentTypeError(f"layer ids must be at most 2**62, got {max(flat)}")
    return LayerIds(tuple(ranges), text)


def check_suffix(path: str, allowed: tuple[str, ...], what: str, flag: str = "-o") -> None:
    """Refuse an output name whose ending is not one of `allowed` (trace.npy or trace.txt for an
    .npz); a name without an ending, and a target that is not a file (/dev/stdout), may take any."""
    ext = Path(path).suffix.lower()
    if ext and ext not in allowed and not is_special_target(path):
        raise EplbError(f"{flag} {path} ends in {ext}, but this writes {what}: name it "
                        f"{' or '.join('*' + a for a in allowed)}")


def add_command(sub, name: str, help: str, example: str) -> argparse.ArgumentParser:
    """A subcommand parser whose help ends with a worked example."""
    return sub.add_parser(
        name, help=help, description=help, epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_output_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON object instead of a table")
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing but errors (and --json output)")


def _default(o: Any):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def json_text(obj: Any) -> str:
    """obj as the indented JSON text `--json` prints (numpy numbers and arrays converted)."""
    return json.dumps(obj, default=_default, indent=2) + "\n"


def print_json(obj: Any) -> None:
    sys.stdout.write(json_text(obj))


def format_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain aligned text table (numbers right-aligned)."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4f}" if abs(v) < 100 else f"{v:,.1f}"
        return str(v)

    body = [[cell(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for r in body:
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def add_topology_arguments(p) -> None:
    """--gpus, --nodes and one of --redundant / --slots-per-gpu, as `backtest` and `replay` take
    them (`plan` has its own --slots-per-gpu, which also takes 'auto')."""
    p.add_argument("--gpus", "-g", type=positive_int, required=True, help="expert-parallel GPUs (ranks)")
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes the GPUs are spread over (default 1)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--redundant", type=int, help=REDUNDANT_HELP)
    size.add_argument("--slots-per-gpu", type=positive_int, help="physical slots per GPU (instead of --redundant)")
