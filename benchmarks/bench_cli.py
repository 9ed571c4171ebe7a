"""Where the wall time of `eplb plan TRACE --gpus 16` goes: whole runs, and a per-phase timer.

    python benchmarks/bench_cli.py [--trace traces/deepseek.npz] [--repeats 5] [--compare DIR --label NAME]
    python benchmarks/bench_cli.py --write-docs          # also writes docs/results/cli.md

Each repeat runs, in fresh processes (the numba cache warm, bytecode compiled as an install has
it), `python -m eplb plan TRACE --gpus 16 -o FILE` (wall, process start included), the same with
`-p greedy` (their CPU time too: user + system, all threads; less swayed by other jobs than
the wall), `python -c pass` (the interpreter's own start), and one run under the phase timer:
a driver that runs `eplb.cli.main()` on the same command line (as `eplb` does: the process
ends after it) and times each phase with `time.perf_counter` by wrapping the functions named
below (inclusive times; indented phases are part of the phase above them), and the process's
shutdown: from main's return to the process's end (wall clock). With --compare, the same runs
of another checkout are interleaved with this one's (A/B in one run: the machine's load drifts,
the ratio holds). Medians.
Data: the trace given (default the shipped synthetic traces/deepseek.npz, 58 x 256, 32 windows).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _report import add_write_docs, results_page  # noqa: E402

# (label, module, attribute, depth): functions wrapped by the phase timer, in the order shown;
# "a|b": the module in this tree, then where an older checkout kept it (for --compare).
PHASES = [
    ("import eplb.cli", None, None, 0),
    ("build the parser", "eplb.cli", "build_parser", 0),
    ("load the trace", "eplb.commands.plan", "load_history", 0),
    ("plan()", "eplb.planning.front_door|eplb.planning", "plan", 0),
    ("robust planner", "planners.robust.RobustPlanner", "plan", 1),
    ("load the kernels (numba)", "planners.robust", "robust_kernels", 2),
    ("replica counts", "planners.robust", "replica_counts_minmax", 2),
    ("packing", "planners.robust", "pack_vector", 2),
    ("swap search", "planners.robust", "refine_swaps", 2),
    ("history score", "planners.robust.RobustPlanner", "_score", 2),
    ("per-window balance", "eplb.commands.plan", "window_balancedness", 0),
    ("write the placement", "eplb.commands.plan", "write_placement", 0),
    ("print the report", "eplb.commands.plan", "_print_report", 0),
]

_DRIVER = r"""
import importlib, json, sys, time
t0 = time.perf_counter()
import eplb.cli
took = {"import eplb.cli": time.perf_counter() - t0}
phases = json.loads(sys.argv[1])
def timed(label, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            took[label] = took.get(label, 0.0) + time.perf_counter() - t
    return wrapper
def patch(label, module, attr):
    # Modules are imported when first reached: the parser imports the command modules.
    # A phase one checkout lacks (a kernel loader gone, a module moved) is left out, shown as "-".
    for name in module.split("|"):
        try:
            owner = importlib.import_module(name) if "RobustPlanner" not in name else \
                importlib.import_module(name.rsplit(".", 1)[0]).RobustPlanner
            fn = getattr(owner, attr)
        except (ImportError, AttributeError):
            continue
        setattr(owner, attr, timed(label, fn))
        return
patch(*phases[0])  # build_parser, before it imports the rest
real_build = eplb.cli.build_parser
def build_then_patch(*a, **k):
    parser = real_build(*a, **k)
    for p in phases[1:]:
        patch(*p)
    return parser
eplb.cli.build_parser = build_then_patch
import io, contextlib
sys.argv = ["eplb"] + sys.argv[2:]  # main() then runs as `eplb ...` does, the process ending after it
with contextlib.redirect_stdout(io.StringIO()):
    rc = eplb.cli.main()
took["total in-process"] = time.perf_counter() - t0
took["_returned"] = time.time()
print(json.dumps(took), flush=True)
sys.exit(rc)
"""


def _env(checkout: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an install has its bytecode compiled
    return env


def _wall(cmd, env, cwd) -> tuple[float, float]:
    """(wall s, CPU s of the process: user + system, its threads together) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(checkout: Path, trace: str, workdir: str) -> dict:
    """One repeat of every run for one checkout: wall times and the phase timer's figures."""
    env = _env(checkout)
    plan = [sys.executable, "-m", "eplb", "plan", trace, "--gpus", "16", "-o", os.path.join(workdir, "p.json")]
    out = {}
    for label, cmd in (("eplb plan (robust)", plan), ("eplb plan -p greedy", plan + ["-p", "greedy"]),
                       ("python -c pass", [sys.executable, "-c", "pass"])):
        out[label], out[label + ", CPU s"] = _wall(cmd, env, workdir)
    # The driver's path argument and the checkout's own copy of the phase list (names may move).
    phases = [(label, m, a) for label, m, a, _ in PHASES if m is not None]
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(phases)] + plan[3:], env=env, cwd=workdir,
                          capture_output=True, text=True, check=True)
    out["phase-timed run"] = time.perf_counter() - t0
    ended = time.time()
    out.update(json.loads(done.stdout.strip().splitlines()[-1]))
    out["shutdown (after main returns)"] = ended - out.pop("_returned")
    return out


def run(args) -> int:
    checkouts = [("this checkout", ROOT)] + ([(args.label, args.compare.resolve())] if args.compare else [])
    trace = str(args.trace.resolve())
    shown = os.path.relpath(trace, ROOT) if trace.startswith(str(ROOT)) else trace
    runs: dict[str, list[dict]] = {name: [] for name, _ in checkouts}
    with tempfile.TemporaryDirectory() as d:
        for _, path in checkouts:  # once untimed: bytecode written, numba's cache checked warm
            measure(path, trace, d)
        for _ in range(args.repeats):
            for name, path in checkouts:
                runs[name].append(measure(path, trace, d))
    labels = ["eplb plan (robust)", "eplb plan (robust), CPU s", "eplb plan -p greedy", "eplb plan -p greedy, CPU s",
              "python -c pass", "phase-timed run",
              "total in-process"] + [label for label, *_ in PHASES] + ["shutdown (after main returns)"]
    depth = {label: d for label, _, _, d in PHASES}
    header = f"| phase (s, median of {args.repeats}) | {' | '.join(n for n, _ in checkouts)} |"
    print(f"`eplb plan {shown} --gpus 16`, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}\n")
    print(header)
    print("|---|" + "---:|" * len(checkouts) + ("---:|" if args.compare else ""))
    for label in labels:
        vals = [float(np.median([r[label] for r in runs[n]])) if label in runs[n][0] else None for n, _ in checkouts]
        both = args.compare and None not in vals and vals[1] > 0
        ratio = (f" | {vals[0] / vals[1]:.2f}x" if both else " | -") if args.compare else ""
        name = "&nbsp;&nbsp;" * depth.get(label, 0) + label
        print(f"| {name} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in vals) + ratio + " |")
    if args.compare:
        print(f"\nlast column: this checkout / {args.label} ({args.compare}), runs interleaved.")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=ROOT / "traces/deepseek.npz")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compare", type=Path, help="another checkout of eplb to time in the same run")
    ap.add_argument("--label", default="compare", help="what --compare is (its column's name), e.g. 'main 1c35176'")
    add_write_docs(ap, "cli")
    args = ap.parse_args(argv)
    with results_page("cli", "Where `eplb plan`'s time goes", args.write_docs, sys.argv[1:] if argv is None else argv):
        return run(args)


if __name__ == "__main__":
    sys.exit(main())
