"""Per-batch re-splitting (`eplb.dispatch.resplit`): time per layer and gap to the exact LP.

    python benchmarks/bench_dispatch.py [--traces ../shared/traces/deepseek_v3_sglang] [--gpus 32]

Legend: L = MoE layers (58), E = logical experts (256), G = GPUs (32), P = slots (288).

Placements are planned on one workload each (the first --plans workloads) by `greedy`,
`deepseek` (DeepSeek's EPLB, 4 nodes, 8 groups) and `ilp` (weighted; --no-ilp to skip) and
served on every workload: the one they were planned on (in-sample) and the others (held-out).
For every (placement, served load, layer) the busiest GPU under `resplit` with a given number
of sweeps is divided by the busiest GPU under the exact LP weights (`optimal_weights`) of
the same placement and load: 1 = optimal. "even" is the even split, for scale.
Times: one `Resplitter` call for all layers (index tables built once per placement, as a
serving engine would), median over repeats, divided by L (wall, and CPU time of this process,
which a busy machine inflates less); plus the one-off table build.
Last table: a stream of batches of --batch-tokens tokens x 8 sampled from a held-out workload's
expert distribution: a cold start each batch vs a warm start from the previous batch's shares.
Real traces are read from --traces when present; else the shipped synthetic trace, else a
seeded heavy-tailed load.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _report import add_write_docs, results_page  # noqa: E402  (benchmarks/_report.py)

from eplb.commands.common import format_table  # noqa: E402
from eplb.core.placement import Placement  # noqa: E402
from eplb.dispatch.rules import Resplitter, optimal_weights  # noqa: E402
from eplb.formats import load_trace  # noqa: E402
from eplb.planning.front_door import plan  # noqa: E402

SWEEPS = (1, 2, 4, 8, 16, 32)


def workloads(traces_dir: Path, fallback: Path, num_logical_experts: int = 256):
    """(name, load_LE) pairs: real traces, else the synthetic trace's windows, else generated loads."""
    if traces_dir.is_dir() and sorted(traces_dir.glob("*.json")):
        return [(f.stem, load_trace(f).counts_TLE.sum(axis=0).astype(np.float64))
                for f in sorted(traces_dir.glob("*.json"))]
    if fallback.is_file():
        c = load_trace(fallback).counts_TLE.astype(np.float64)
        return [(f"{fallback.name} window {t}", c[t]) for t in range(min(len(c), 8))]
    rng = np.random.default_rng(0)
    return [(f"generated {i}", np.floor(rng.pareto(1.2, (58, num_logical_experts)) * 1000) + 1) for i in range(4)]


def busiest(p: Placement, load_LE, w_LP=None) -> np.ndarray:
    return p.gpu_loads(load_LE, w_LP).max(axis=1)


def pct(a, q) -> float:
    return float(np.percentile(a, q))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=ROOT.parent / "shared/traces/deepseek_v3_sglang")
    ap.add_argument("--fallback", type=Path, default=ROOT / "traces/deepseek.npz")
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--plans", type=int, default=3, help="plan on the first N workloads")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--no-ilp", action="store_true")
    add_write_docs(ap, "dispatch")
    args = ap.parse_args(argv)
    with results_page("dispatch", "Dispatch: per-batch resplit vs the exact LP weights", args.write_docs, argv):
        return run(args)


def run(args) -> int:
    """The benchmark itself: print its tables (main() adds the results page)."""
    loads = workloads(args.traces, args.fallback)
    G = args.gpus
    planners = ["greedy", "deepseek"] + ([] if args.no_ilp else ["ilp"])
    settings = {"ilp": {"quiet": True}}

    ratio: dict[tuple[str, str, object], list] = {}   # (planner, in/held, sweeps) -> ratios
    times: dict[str, dict] = {}
    placements = {}
    for i, (_, load_LE) in enumerate(loads[: args.plans]):
        for planner in planners:
            res = plan(load_LE, num_gpus=G, num_nodes=args.nodes, num_redundant=G, planner=planner,
                       settings=settings.get(planner), num_expert_groups=8)
            p = res.placement.with_weights(None)
            placements[planner, i] = p
            t0 = time.perf_counter()
            rs = Resplitter(p)
            build = time.perf_counter() - t0
            L = p.num_layers
            tt = times.setdefault(planner, {"build": [], **{s: [] for s in SWEEPS},
                                            **{("cpu", s): [] for s in SWEEPS}})
            tt["build"].append(build)
            for s in SWEEPS:
                for _ in range(args.repeats):
                    c0, t0 = time.process_time(), time.perf_counter()
                    rs(load_LE, sweeps=s)
                    tt[s].append((time.perf_counter() - t0) / L)
                    tt["cpu", s].append((time.process_time() - c0) / L)
            for j, (_, served_LE) in enumerate(loads):
                where = "in-sample" if j == i else "held-out"
                opt_L = busiest(p, served_LE, optimal_weights(p, served_LE))
                ratio.setdefault((planner, where, "even"), []).append(busiest(p, served_LE) / opt_L)
                for s in SWEEPS:
                    ratio.setdefault((planner, where, s), []).append(busiest(p, served_LE, rs(served_LE, s)) / opt_L)

    rows = []
    for planner in planners:
        for where in ("in-sample", "held-out"):
            for s in ("even",) + SWEEPS:
                r = np.concatenate(ratio[planner, where, s])
                t = "" if s == "even" else f"{1e3 * np.median(times[planner][s]):.3f}"
                c = "" if s == "even" else f"{1e3 * np.median(times[planner]['cpu', s]):.3f}"
                rows.append((planner, where, s, f"{np.median(r):.5f}", f"{pct(r, 90):.5f}", f"{pct(r, 99):.5f}",
                             f"{r.max():.5f}", t, c))
    print(f"G = {G}, placements planned on {min(args.plans, len(loads))} workload(s), served on {len(loads)}; "
          f"busiest GPU under resplit / under the exact LP weights, over layers x served loads")
    print(format_table(["planner", "served", "sweeps", "median", "p90", "p99", "max", "ms / layer",
                        "CPU ms / layer"], rows))
    print("Resplitter table build, ms per placement (once per rebalance): " + ", ".join(
        f"{k} {1e3 * np.median(v['build']):.1f}" for k, v in times.items()))

    # Batches: warm vs cold start.
    p = placements["greedy", 0]
    _, served_LE = loads[-1]
    rng = np.random.default_rng(0)
    prob_LE = served_LE / served_LE.sum(axis=1, keepdims=True)
    batches = [np.stack([rng.multinomial(args.batch_tokens * 8, q) for q in prob_LE]).astype(np.float64)
               for _ in range(args.batches)]
    opt = [busiest(p, b, optimal_weights(p, b)) for b in batches]
    rows = []
    for s in (1, 2, 4, 8):
        for warm in (False, True):
            rs = Resplitter(p)
            rs(batches[0], sweeps=s)
            r = np.concatenate([busiest(p, b, rs(b, sweeps=s, warm=warm)) / o for b, o in zip(batches[1:], opt[1:])])
            rows.append((s, "warm" if warm else "cold", f"{np.median(r):.5f}", f"{pct(r, 99):.5f}", f"{r.max():.5f}"))
    even = np.concatenate([busiest(p, b) / o for b, o in zip(batches[1:], opt[1:])])
    print(f"\nBatches of {args.batch_tokens} tokens x 8 from {loads[-1][0]} on the greedy placement of {loads[0][0]} "
          f"(even split: median {np.median(even):.5f}, max {even.max():.5f})")
    print(format_table(["sweeps", "start", "median", "p99", "max"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
