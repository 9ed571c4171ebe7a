"""Command-line interface: `eplb <command> ...`, a thin layer over the library.

Each command lives in `eplb/commands/<name>.py` with `add_parser(subparsers)` and
`run(args) -> int`; command modules import heavy libraries (torch, matplotlib, OR-Tools)
only inside `run`, and a command line that names its command imports only that command's
module (`eplb --help` imports them all), so `eplb plan` starts fast. Errors are caught here, at one boundary:
bad input (EplbError, or a path that cannot be read or
written) prints one line and exits 2; a failure (PlanningError) exits 1; a reader that
closes the pipe early (`eplb stats ... --json | head`) ends the command quietly with 0.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from collections.abc import Sequence

from eplb._version import __version__
from eplb.errors import EplbError, PlanningError

# Order shown in `eplb --help`; each name is a module in eplb/commands/.
COMMANDS = ["plan", "stats", "inspect", "plot", "capacity", "synth", "backtest", "replay", "simulate",
            "calibrate"]

EPILOG = """examples:
  eplb plan traces/deepseek.npz --gpus 16 -o plan.json
  eplb stats traces/deepseek.npz
  eplb inspect plan.json
  eplb plot balance traces/deepseek.npz --gpus 32 -o balance.png
  eplb replay traces/deepseek.npz --gpus 32 --redundant 32 -o replay.npz
  eplb capacity --model deepseek-v3 --gpus 32 --gpu-memory h200 --context 8192 --concurrency 2048
  eplb simulate traces/deepseek.npz --plan plan.json --model deepseek-v3 --hardware h200
run `eplb COMMAND --help` for a command's options and an example."""


def build_parser(commands: Sequence[str] = COMMANDS) -> argparse.ArgumentParser:
    """The `eplb` parser with the subcommands `commands` (all by default)."""
    parser = argparse.ArgumentParser(
        prog="eplb",
        description="Expert-parallel load balancing for Mixture-of-Experts serving.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"eplb {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in commands:
        module = importlib.import_module(f"eplb.commands.{name}")
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run, _parser=p)
    return parser


def commands_named(argv: Sequence[str]) -> Sequence[str]:
    """The subcommands a parser for argv needs: the command argv starts with, or all of them
    (for `eplb --help`, `--version`, a typo: the top-level parser lists or suggests them)."""
    # The top-level parser has options (-h, --version) but none that take a value, so a
    # command line that names a command names it first.
    return [argv[0]] if argv and argv[0] in COMMANDS else COMMANDS


def main(argv: list[str] | None = None) -> int:
    """Run one command line and return its exit status; argv None: this process's own command
    line (`eplb ...`, `python -m eplb ...`), after which the process ends."""
    if argv is not None:
        return _run(list(argv))
    code = _run(sys.argv[1:], whole_process=True)
    # Numba's type registries and loaded kernels are a large graph of objects that the
    # interpreter's shutdown would walk in garbage-collection passes, a large share of a short
    # command's wall time; frozen, they are skipped and their memory goes back to the OS with
    # the process (files are closed, output flushed and atexit handlers run as before).
    gc.freeze()
    return code


def _run(argv: list[str], whole_process: bool = False) -> int:
    parser = build_parser(commands_named(argv))
    if whole_process:
        # What the imports made lives until the process ends: the command's collections need
        # not walk it (the collector's permanent generation).
        gc.freeze()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            # Unknown options or stray arguments belong to the command: say so in its name
            # and with its usage line (the top-level parser would say "eplb: error").
            (getattr(args, "_parser", None) or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except EplbError as exc:
        print(f"eplb {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # before OSError, its base class: `eplb ... | head` is not an error of ours
        _silence_stdout()
        return 0
    except OSError as exc:  # a path that cannot be read or written (missing folder, permissions)
        where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
        print(f"eplb {args.command}: error: {one_line(exc.strerror or exc)}{one_line(where)}", file=sys.stderr)
        return 2
    except PlanningError as exc:
        print(f"eplb {args.command}: failed: {one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"eplb {args.command}: interrupted", file=sys.stderr)
        return 130


MAX_MESSAGE = 2000
"""Longest error line printed (a message quoting a value is cut, not printed for pages)."""


def one_line(message) -> str:
    """A message as one printable line: a file name or a library's text may hold line breaks or
    terminal escapes (shown escaped, as \\n and \\x1b), and is cut at MAX_MESSAGE characters."""
    text = str(message)
    if len(text) > MAX_MESSAGE:
        text = text[:MAX_MESSAGE] + "..."
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _silence_stdout() -> None:
    """Point stdout at /dev/null after a broken pipe, so the interpreter's last flush of the
    unwritten rest does not raise again ("Exception ignored ... BrokenPipeError", exit 120)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (tests capture stdout)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
