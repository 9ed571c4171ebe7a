"""Balance as eplb reports it and as each engine's dispatch rule serves it, per planner.

    python benchmarks/bench_engines.py [--traces ../shared/traces/deepseek_v3_sglang] [--gpus 32]
        [--nodes 4] [--redundant 32] [--part planners|migration|all] [--write-docs]

Legend: L = MoE layers, E = logical experts, G = GPUs, N = nodes, P = slots.

For each workload (a real trace file, or a window of the synthetic trace without --traces):
- in-sample: plan on the workload, serve the same workload;
- leave-one-workload-out: plan on the other workloads (each scaled to the same total, given
  as windows of history: robust and rule-aware plan against each, the others on their sum),
  serve the held-out one.
Planners: eplb greedy, hierarchical, robust, rule-aware (planned for SGLang static), DeepSeek
global and hierarchical (eplb's exact port of deepseek-ai/EPLB). Figures: busiest / mean GPU
per layer, median and max over every (workload, layer), under
- "eplb": the plan's own weights (even split without them), what `eplb plan` reports;
- "vLLM / TensorRT-LLM": even split (hash or round-robin over replicas);
- "SGLang static" and "SGLang dynamic": eplb.dispatch.sglang, the start-up path (the map an
  `--init-expert-location` export gets), checked against SGLang's own function in tests/engines.
Part "migration" (benchmarks/bench_engines_migration.py, docs/results/engines-migration.md):
planning from the placement served now under SGLang's rules.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench_engines_migration  # noqa: E402
from _report import write_results  # noqa: E402  (benchmarks/_report.py)

from eplb.commands.common import format_table  # noqa: E402
from eplb.core.trace import Trace  # noqa: E402
from eplb.dispatch.rules import EvenSplit, engine_rule  # noqa: E402
from eplb.formats import load_trace  # noqa: E402
from eplb.planning.front_door import plan  # noqa: E402
from eplb.stats.loads import imbalance  # noqa: E402

DEFAULT_TRACES = str(ROOT.parent / "shared" / "traces" / "deepseek_v3_sglang")
PLANNERS = [
    ("greedy", "greedy", {}),
    ("hierarchical", "hierarchical", {}),
    ("robust", "robust", {}),
    ("rule-aware (SGLang static)", "rule-aware", {}),
    ("DeepSeek global", "deepseek", {"policy": "global"}),
    ("DeepSeek hierarchical", "deepseek", {"policy": "hierarchical"}),
]
RULES = [("eplb", None), ("vLLM / TensorRT-LLM", EvenSplit()), ("SGLang static", engine_rule("sglang", "static")),
         ("SGLang dynamic", engine_rule("sglang", "dynamic"))]


def workloads(traces_dir: Path, fallback: Path):
    """(name, counts_LE, layer_ids, meta): real trace files, else windows of the synthetic trace."""
    if traces_dir.is_dir() and sorted(traces_dir.glob("*.json")):
        out = []
        for f in sorted(traces_dir.glob("*.json")):
            t = load_trace(f)
            out.append((f.stem, t.counts_TLE.sum(axis=0), t.layer_ids, t.meta))
        return out, f"real SGLang DeepSeek-V3 traces ({traces_dir})"
    t = load_trace(fallback)
    # 8 workloads of 4 consecutive windows each (the trace alternates prefill and decode runs).
    c = t.counts_TLE
    return ([(f"windows {4 * i}-{4 * i + 3}", c[4 * i:4 * i + 4].sum(axis=0), t.layer_ids, t.meta)
             for i in range(min(8, len(c) // 4))], f"synthetic {fallback.name} (no --traces)")


def served(placement, load_LE, rule) -> np.ndarray:
    w = None if rule is None else rule.bind(placement)(load_LE)
    return imbalance(placement.gpu_loads(load_LE, w))


def run(args) -> tuple[str, str]:
    data, source = workloads(Path(args.traces), ROOT / "traces" / "deepseek.npz")
    topo = dict(num_gpus=args.gpus, num_nodes=args.nodes, num_redundant=args.redundant, num_expert_groups=8)
    static = engine_rule("sglang", "static")
    scores = {(p, s, r): [] for p, _, _ in PLANNERS for s in ("in", "loo") for r, _ in RULES}
    seconds = {p: [] for p, _, _ in PLANNERS}
    for i, (name, load, ids, meta) in enumerate(data):
        rest = [d[1] / d[1].sum() for j, d in enumerate(data) if j != i]
        history = Trace(np.rint(np.stack(rest) * 1e9).astype(np.int64), ids, meta)
        for label, planner, settings in PLANNERS:
            dispatch = static if planner == "rule-aware" else None
            for split, trace in (("in", Trace(load[None].astype(np.int64), ids, meta)), ("loo", history)):
                t0 = time.perf_counter()
                p = plan(trace, planner=planner, settings=settings, dispatch=dispatch, **topo).placement
                if split == "in":
                    seconds[label].append(time.perf_counter() - t0)
                for rule_name, rule in RULES:
                    scores[(label, split, rule_name)].append(served(p, load.astype(np.float64), rule))
        print(f"  {name}: done", file=sys.stderr)
    header = ["planner", "split"] + [f"{r}: median (max)" for r, _ in RULES] + ["plan s (median)"]
    rows = []
    for label, _, _ in PLANNERS:
        for split in ("in", "loo"):
            cells = []
            for r, _ in RULES:
                a = np.concatenate(scores[(label, split, r)])
                cells.append(f"{np.median(a):.3f} ({a.max():.3f})")
            rows.append([label, "in-sample" if split == "in" else "leave-one-out"] + cells
                        + [f"{np.median(seconds[label]):.2f}" if split == "in" else ""])
    table = format_table(header, rows)
    setup = (f"{args.gpus} GPUs on {args.nodes} nodes, {args.redundant} redundant slots; {len(data)} workloads "
             f"x {len(data[0][1])} MoE layers; data: {source}")
    return table, setup


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=DEFAULT_TRACES)
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--redundant", type=int, default=32)
    ap.add_argument("--part", choices=("planners", "migration", "all"), default="all",
                    help="planners: balance per planner and rule; migration: planning from a served placement")
    ap.add_argument("--write-docs", action="store_true",
                    help="write docs/results/engines.md (planners) and engines-migration.md (migration)")
    args = ap.parse_args(argv)
    if args.part in ("migration", "all"):
        cmd = "python benchmarks/bench_engines.py --part migration --write-docs" + (
            "" if args.traces == DEFAULT_TRACES else f" --traces {args.traces}")
        bench_engines_migration.main(args, workloads(Path(args.traces), ROOT / "traces" / "deepseek.npz"),
                                     "engines-migration", cmd)
    if args.part == "migration":
        return 0
    table, setup = run(args)
    print(setup)
    print(table)
    if args.write_docs:
        cmd = "python benchmarks/bench_engines.py --part planners --write-docs" + (
            "" if args.traces == DEFAULT_TRACES else f" --traces {args.traces}")
        out = write_results(
            "engines",
            "# Engines: balance as planned and as served\n\n"
            f"Written by `{cmd}` ({setup}).\n\n"
            "Busiest / mean GPU per layer, median (max) over every workload and layer. Columns: the dispatch "
            "rule the figure is scored under (`eplb`: the plan's own weights, an even split without them; "
            "SGLang: the start-up path of an `--init-expert-location` export, eplb.dispatch.sglang). "
            "In-sample: planned and served on the same workload; leave-one-out: planned on the other "
            "workloads (as windows), served on the held-out one. Plan time: wall seconds of one in-sample "
            "plan on this machine (2 shared cores).\n\n"
            "```\n" + table + "\n```\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
