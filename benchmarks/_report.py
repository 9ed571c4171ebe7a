"""Results pages for the benchmarks: `--write-docs` writes what a script printed to docs/results/.

A benchmark opts in with three lines (imported as a sibling module, like `workloads`):

    from _report import add_write_docs, results_page
    add_write_docs(ap, "greedy")                          # adds --write-docs to the parser
    with results_page("greedy", "Greedy vs DeepSeek's EPLB", args.write_docs, argv):
        return run(args)                                  # everything printed goes to the page too

or, for a script that builds its tables as strings, `write_page(name, title, text, argv)`, or
`write_results(name, text)` for a page the script lays out whole.
The page starts with the exact command, the date, and the machine's core count and load
average (timings on a shared machine are upper bounds), then the output in a code block.
Paths of this machine are written as a reader's checkout sees them (`portable`): the shared
data beside the checkout as `../shared/...`, the checkout itself as `.`, a site-packages or
PYTHONPATH copy of SGLang from its package folder on (`sglang/srt/...`).
It is written atomically through eplb.core.files (a temporary file, synced, then renamed), so a
failed run never leaves half a page and a run that raises leaves the old page untouched.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
if str(ROOT) not in sys.path:  # the benchmarks put the checkout first; a lone import of this module too
    sys.path.insert(0, str(ROOT))

from eplb.core.outputs import write_text  # noqa: E402


def portable(text: str) -> str:
    """`text` with this machine's absolute paths replaced by the ones a reader's checkout has."""
    text = text.replace(str(ROOT.parent / "shared"), "../shared")
    text = re.sub(r"(?<![\w.])/[^\s`'\"()]*?/(sglang/srt/)", r"\1", text)
    return text.replace(str(ROOT) + "/", "").replace(str(ROOT), ".")


def write_results(name: str, text: str) -> Path:
    """Write docs/results/<name>.md as given (after `portable`), atomically."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    return write_text(RESULTS / f"{name}.md", portable(text), what="the results page")


def add_write_docs(parser, name: str) -> None:
    """Add `--write-docs` (write docs/results/<name>.md) to an argparse parser."""
    parser.add_argument("--write-docs", action="store_true",
                        help=f"also write the output to docs/results/{name}.md")


def command_line(argv=None) -> str:
    """The command that reproduces this run: `python benchmarks/<script> <argv>`."""
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0].endswith(".py") else "<script>"
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", f"benchmarks/{script}", *args])


def _machine() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    loads = "n/a" if load is None else f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min)"
    return f"{os.cpu_count()} cores, load average {loads}"


def write_page(name: str, title: str, text: str, argv=None, *, notes: str = "",
               started: str | None = None) -> Path:
    """Write docs/results/<name>.md: a header naming the command, date and machine, then `text`.

    `notes` is prose placed between the header and the output (what the columns mean);
    `started` is the machine line measured when the run began (default: measured now).
    """
    RESULTS.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"start: {started}; end: {_machine()}" if started else _machine()
    body = (f"# {title}\n\nWritten by `{command_line(argv)}` on {date}; {machine}. "
            "Timings on a shared machine are upper bounds: read the ratios.\n\n")
    if notes:
        body += notes.strip() + "\n\n"
    body += "```\n" + text.strip("\n") + "\n```\n"
    return write_results(name, body)


class _Tee(io.TextIOBase):
    def __init__(self, stream):
        self.stream, self.buffer_ = stream, io.StringIO()

    def write(self, s):
        self.buffer_.write(s)
        return self.stream.write(s)

    def flush(self):
        self.stream.flush()


@contextlib.contextmanager
def results_page(name: str, title: str, enabled: bool, argv=None, *, notes: str = ""):
    """Copy everything printed inside the block to docs/results/<name>.md when `enabled`.

    The page is written only when the block finishes without raising.
    """
    if not enabled:
        yield
        return
    started = _machine()
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield
    out = write_page(name, title, tee.buffer_.getvalue(), argv, notes=notes, started=started)
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
