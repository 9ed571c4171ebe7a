"""The `ilp` planner (CP-SAT) in-sample on DeepSeek-V3 workloads: how close to the lower bound.

    python benchmarks/bench_ilp.py [--traces ../shared/traces/deepseek_v3_sglang] [--gpus 32]
    python benchmarks/bench_ilp.py --gpus 16 --workloads 2 --no-even --no-parallel

Legend: L = MoE layers (58), E = logical experts (256), G = GPUs, P = slots (E + G by default).

In-sample: plan and score on the same load (each workload's counts summed). Ratios are the
busiest GPU / the analytic lower bound (`eplb.stats.lower_bound`), median and max over layers.
Part 1, weighted dispatch, every workload: greedy with an even split, greedy with its exact LP
weights, and `ilp` (default settings); status, layers proven optimal, layers that needed a
CP-SAT search (the rest met the bound with the hint alone), largest proven gap, wall time.
Part 2, even dispatch (`dispatch="even"`), the first `--even-workloads` workloads, default
settings: the whole 58-layer plan must take < 10 minutes on 2 cores.
Part 3, layers in parallel: `jobs` x `workers` = 2 x 1 vs 1 x 2 on the same searched layers.
Real traces are read from --traces when present; else the shipped synthetic trace, else a
seeded heavy-tailed load.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _report import add_write_docs, results_page  # noqa: E402  (benchmarks/_report.py)
from workloads import workloads  # noqa: E402  (benchmarks/workloads.py)

from eplb import stats  # noqa: E402
from eplb.commands.common import format_table  # noqa: E402
from eplb.core.placement import Placement  # noqa: E402
from eplb.core.topology import Topology  # noqa: E402
from eplb.dispatch.rules import optimal_weights  # noqa: E402
from eplb.planning.front_door import plan  # noqa: E402
from planners.greedy import plan_greedy  # noqa: E402
from planners.ilp_model import scale_loads, solve_layer  # noqa: E402


def med_max(a) -> str:
    a = np.asarray(a, dtype=np.float64)
    return f"{np.median(a):.5f} / {a.max():.5f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=ROOT.parent / "shared/traces/deepseek_v3_sglang")
    ap.add_argument("--fallback", type=Path, default=ROOT / "traces/deepseek.npz")
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--redundant", type=int, default=None, help="redundant slots (default: one per GPU)")
    ap.add_argument("--workloads", type=int, default=None, help="use only the first N workloads")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds: the whole plan in Parts 1-2 (default: the planner's), a layer in Part 3 (8)")
    ap.add_argument("--even-workloads", type=int, default=1)
    ap.add_argument("--no-even", action="store_true")
    ap.add_argument("--no-parallel", action="store_true")
    ap.add_argument("--parallel-layers", type=int, default=6)
    add_write_docs(ap, "ilp")
    args = ap.parse_args(argv)
    with results_page("ilp", "Exact planning: ilp (CP-SAT) vs greedy", args.write_docs, argv):
        return run(args)


def run(args) -> int:
    """The benchmark itself: print its tables (main() adds the results page)."""
    G = args.gpus
    num_redundant = G if args.redundant is None else args.redundant
    extra = {} if args.time_limit is None else {"time_limit": args.time_limit}
    print(f"{os.cpu_count()} cores; G = {G}, redundant = {num_redundant}")
    loads = list(workloads(args.traces, args.fallback))[: args.workloads]

    # Part 1: weighted dispatch.
    rows = []
    ilp_med = []
    for name, load_LE in loads:
        L, E = load_LE.shape
        P = E + num_redundant
        S = P // G
        lb_L = stats.lower_bound(load_LE, G, P)
        greedy = Placement(plan_greedy(load_LE, G, S), G, E)
        even_L = greedy.gpu_loads(load_LE).max(axis=1) / lb_L
        lp_L = greedy.gpu_loads(load_LE, optimal_weights(greedy, load_LE)).max(axis=1) / lb_L
        t0 = time.perf_counter()
        res = plan(load_LE, num_gpus=G, num_redundant=num_redundant, planner="ilp", settings={"quiet": True, **extra})
        sec = time.perf_counter() - t0
        ilp_L = res.after.bound_ratio_L
        ilp_med.append(np.median(ilp_L))
        gaps = [g for g in res.info["gap_L"] if g is not None]
        rows.append((name, med_max(even_L), med_max(lp_L), med_max(ilp_L), res.status,
                     f"{sum(s == 'OPTIMAL' for s in res.info['status_L'])}/{L}",
                     res.info["searched_layers"], f"{100 * max(gaps, default=0):.3f}%", f"{sec:.1f}"))
    print("\nPart 1: in-sample, weighted dispatch; busiest GPU / lower bound (median / max over layers)")
    print(format_table(["workload", "greedy even", "greedy + LP weights", "ilp weighted", "status",
                        "optimal", "searched", "max gap", "seconds"], rows))
    print(f"ilp weighted, median over workloads of the per-layer median: {np.median(ilp_med):.5f} "
          f"(target <= 1.002)")

    # Part 2: even dispatch, the whole model with default settings.
    if not args.no_even:
        rows = []
        for name, load_LE in loads[: args.even_workloads]:
            L, E = load_LE.shape
            P = E + num_redundant
            lb_L = stats.lower_bound(load_LE, G, P)
            greedy = Placement(plan_greedy(load_LE, G, P // G), G, E)
            even_L = greedy.gpu_loads(load_LE).max(axis=1) / lb_L
            t0 = time.perf_counter()
            res = plan(load_LE, num_gpus=G, num_redundant=num_redundant, planner="ilp",
                       settings={"dispatch": "even", "quiet": True, **extra})
            sec = time.perf_counter() - t0
            gaps = [g for g in res.info["gap_L"] if g is not None]
            refined = Placement(plan_greedy(load_LE, G, P // G, refine_rounds=64), G, E)
            rows.append((name, med_max(even_L), med_max(refined.gpu_loads(load_LE).max(axis=1) / lb_L),
                         med_max(res.after.bound_ratio_L), res.status,
                         f"{sum(s == 'OPTIMAL' for s in res.info['status_L'])}/{L}",
                         f"{len(res.info['unanswered_layers'])}/{L}",
                         f"{100 * np.median(gaps):.3f}% / {100 * max(gaps, default=0):.3f}%",
                         f"{res.info['jobs']} x {res.info['workers']}", f"{sec:.1f}"))
        print("\nPart 2: in-sample, even dispatch (default settings); busiest GPU / lower bound")
        print(format_table(["workload", "greedy", "greedy refine=64", "ilp even", "status", "optimal",
                            "no CP-SAT answer", "proven gap med / max", "jobs x workers", "seconds"], rows))

    # Part 3: two layers at a time on one thread each, or one layer at a time on two threads.
    if not args.no_parallel:
        from concurrent.futures import ThreadPoolExecutor

        name, load_LE = loads[0]
        L, E = load_LE.shape
        P = E + num_redundant
        S = P // G
        tl = args.time_limit or 8.0
        layers = np.linspace(0, L - 1, args.parallel_layers).astype(int)
        int_LE = np.stack([scale_loads(load_LE[l]) for l in layers])
        hint_LP = plan_greedy(int_LE.astype(np.float64), G, S, refine_rounds=64)
        rows = []
        for jobs, workers in ((2, 1), (1, 2)):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(jobs) as pool:
                def one(i, workers=workers):
                    return solve_layer(int_LE[i], hint_LP[i], None, Topology(G, S), "even", tl, workers, 0)
                outs = list(pool.map(one, range(len(layers))))
            sec = time.perf_counter() - t0
            # No CP-SAT answer in time: the planner keeps the hint, so score that.
            obj = [o["hint_objective"] if o["objective"] is None else o["objective"] for o in outs]
            bound = [o["lower"] if o["bound"] is None else max(o["bound"], o["lower"]) for o in outs]
            ratio = [v / o["lower"] for v, o in zip(obj, outs)]
            gap = [(v - b) / v for v, b in zip(obj, bound)]
            answered = sum(o["objective"] is not None for o in outs)
            rows.append((f"{jobs} x {workers}", f"{answered}/{len(layers)}", f"{np.mean(ratio):.5f}",
                         f"{100 * np.mean(gap):.3f}%", f"{sec:.1f}", f"{sec / len(layers):.1f}"))
        print(f"\nPart 3: even dispatch, {len(layers)} layers of {name}, {tl:g} s per layer: "
              f"layers at once x CP-SAT threads each")
        print(format_table(["jobs x workers", "CP-SAT answered", "mean objective / bound", "mean proven gap", "seconds",
                            "seconds / layer"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
