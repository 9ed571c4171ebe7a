"""Helpers shared by CLI commands: subcommand parsers with examples, JSON output, tables."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from eplb.core.files import same_file
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
    parent = p.parent
    if not parent.is_dir():
        raise EplbError(f"cannot write {what} to {path!r}: folder {str(parent)!r} does not exist (No such file or "
                        f"directory); give {flag} a path in an existing, writable folder")
    if not os.access(parent, os.W_OK):
        raise EplbError(f"cannot write {what} to {path!r}: folder {str(parent)!r} is not writable (Permission "
                        f"denied); give {flag} a path in an existing, writable folder")


def layer_id_list(text: str) -> list[int]:
    """argparse type: hidden-layer ids as '3-60', '3..60', '1,3,5' or '0,3-5' (sorted, distinct)."""
    ids: list[int] = []
    try:
        for part in text.replace("..", "-").split(","):
            lo, sep, hi = part.strip().partition("-")
            a = int(lo)
            ids.extend(range(a, int(hi) + 1) if sep else [a])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected hidden-layer ids like 3-60 or 1,3,5, got {text!r}") from None
    if not ids or min(ids) < 0 or any(b <= a for a, b in zip(ids, ids[1:])):
        raise argparse.ArgumentTypeError(f"layer ids must be increasing and >= 0, got {text!r}")
    return ids


KNOWN_SUFFIXES = (".json", ".npz", ".npy", ".pt", ".pth", ".yaml", ".yml", ".png", ".svg", ".pdf", ".safetensors")
"""File name endings that say what a file holds: an output of another kind under one is refused."""


def check_suffix(path: str, allowed: tuple[str, ...], what: str, flag: str = "-o") -> None:
    """Refuse an output name whose ending says another kind of file (trace.npy for an .npz)."""
    ext = Path(path).suffix.lower()
    if ext in KNOWN_SUFFIXES and ext not in allowed:
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
