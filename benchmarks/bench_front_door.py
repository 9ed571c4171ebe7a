"""What the front door costs: `eplb.plan()` against the planner alone, side by side in one run.

    python benchmarks/bench_front_door.py [--traces ../shared/traces/deepseek_v3_sglang] [--gpus 32]
    python benchmarks/bench_front_door.py --repeats 40 --write-docs     # -> docs/results/front_door.md

Legend: L = MoE layers (58), E = logical experts (256), G = GPUs, P = slots (E + G).

For the first workload (an SGLang JSON in --traces when that folder exists, else the shipped
synthetic traces/deepseek.npz summed over its windows), each repeat times, interleaved:
- the planner alone: `get_planner(name).plan(PlanRequest(load_LE, topology))`;
- `eplb.plan(load_LE, num_gpus=G, planner=name)`: what a serving loop pays (scores are lazy);
- the same plus reading its report (`after`, `before`, `lower_bound_L`, `placement` with its
  metrics): what the CLI pays.
The fastest and the median wall time over the repeats, each also as a ratio to the planner alone:
on a shared machine the minimum is the call's own cost, the median adds the neighbours' noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _report import write_results  # noqa: E402  (benchmarks/_report.py)
from workloads import workloads  # noqa: E402  (benchmarks/workloads.py)

import eplb  # noqa: E402
from eplb.commands.common import format_table  # noqa: E402
from eplb.core.topology import Topology  # noqa: E402
from planners.api import PlanRequest, get_planner  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=ROOT.parent / "shared/traces/deepseek_v3_sglang")
    ap.add_argument("--fallback", type=Path, default=ROOT / "traces/deepseek.npz")
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--planner", default="greedy")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--write-docs", action="store_true", help="also write docs/results/front_door.md")
    args = ap.parse_args(argv)

    name, load_LE = next(iter(workloads(args.traces, args.fallback)))
    L, E = load_LE.shape
    topo = Topology.for_experts(E, num_gpus=args.gpus)
    impl = get_planner(args.planner)
    request = PlanRequest(load_LE, topo)

    def front_door_and_report():
        r = eplb.plan(load_LE, num_gpus=args.gpus, planner=args.planner)
        return r.after, r.before, r.lower_bound_L, r.placement

    cases = {
        "planner alone": lambda: impl.plan(request),
        "eplb.plan()": lambda: eplb.plan(load_LE, num_gpus=args.gpus, planner=args.planner),
        "eplb.plan() + report": front_door_and_report,
    }
    for fn in cases.values():  # warm caches and imports
        fn()
    seconds = {k: [] for k in cases}
    for _ in range(args.repeats):
        for k, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            seconds[k].append(time.perf_counter() - t0)
    fastest, median = min(seconds["planner alone"]), statistics.median(seconds["planner alone"])
    rows = [[k, 1e3 * min(v), min(v) / fastest, 1e3 * statistics.median(v), statistics.median(v) / median]
            for k, v in seconds.items()]
    head = (f"{name}: {L} layers x {E} experts, {topo.num_gpus} GPUs, {topo.num_slots} slots; planner "
            f"{args.planner}; {args.repeats} interleaved repeats")
    table = format_table(["call", "min ms", "x alone", "median ms", "x alone"], rows)
    print(head)
    print(table)
    if args.write_docs:
        out = write_results("front_door", f"# Front-door overhead\n\nWritten by `python benchmarks/bench_front_door.py "
                        f"--repeats {args.repeats} --write-docs`.\n\n{head}\n\n```\n{table}\n```\n")
        print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
