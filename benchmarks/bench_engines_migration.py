"""Planning from the placement served now, under SGLang's rules: balance served, moves, against a plan from scratch.

    python benchmarks/bench_engines.py --part migration [--traces ../shared/traces/deepseek_v3_sglang]
        [--gpus 32] [--nodes 4] [--redundant 32] [--write-docs]

Legend: L = MoE layers, E = logical experts, G = GPUs, N = nodes, P = slots.

For every workload i (the next one, i + 1, plays the past): the rule-aware plan for workload
i + 1 is serving when traffic becomes workload i. Compared, all planned on workload i and
served on it under the rule (in-sample: the question is what the migration step keeps):
- from scratch: the rule-aware plan for i, no previous placement (the reference);
- keep: the previous placement served as it is (0 moves);
- even-split migration: the plan from scratch relabelled onto the previous placement by
  `eplb.migration.migrate`, the migration step for even splits, here served under SGLang's rule;
- `plan(..., previous=..., budget=...)` with no move limit, a move limit, and the
  Rebalancer's default price per move.
Rules: SGLang static with the start-up map (`SglangStatic()`, what `dispatch="sglang-static"`
binds) and with the map SGLang builds after its periodic rebalance (`path="rebalance"`, what
the SGLang plug-in plans for). Figures: busiest / mean GPU per layer under the rule, median
(max) over every (workload, layer); per workload, the ratio of the migrated plan's median and
max to the plan from scratch (worst workload shown); the summed busiest-GPU load over layers
against keeping the previous placement (worst workload); layers served worse than keeping it;
moves (copies onto a GPU that lacked the expert) per workload, mean (max).
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
from _report import write_results  # benchmarks/_report.py, a sibling like this module

from eplb.commands.common import format_table
from eplb.core.placement import Placement
from eplb.core.topology import Topology
from eplb.core.trace import Trace
from eplb.dispatch.sglang import SglangStatic
from eplb.migration import Budget, count_moves, migrate
from eplb.planning.front_door import plan
from eplb.stats.loads import imbalance

RULES = [("start-up map", SglangStatic()), ("after a rebalance", SglangStatic(path="rebalance"))]
BUDGETS = [("no move limit", Budget()), ("max_moves=200", Budget(max_moves=200)),
           ("move_cost=0.001 (Rebalancer default)", Budget(move_cost=0.001))]


def _served(phy2log_LP, load_LE, rule, topo: dict, layer_ids) -> np.ndarray:
    """Tokens each GPU serves when `rule` dispatches load_LE on the map, [L, G]."""
    p = Placement(phy2log_LP, topo["num_gpus"], load_LE.shape[1], topo["num_nodes"], layer_ids)
    return p.gpu_loads(load_LE, rule.bind(p)(load_LE))


def _rows_for_rule(rule, data, topo: dict):
    """{method: per-workload records (gpu_load_LG, moves, chosen method, seconds)}."""
    G, N = topo["num_gpus"], topo["num_nodes"]
    traces = [Trace(load[None].astype(np.int64), ids, meta) for _, load, ids, meta in data]
    scratch = []
    for t in traces:
        t0 = time.perf_counter()
        scratch.append((plan(t, dispatch=rule, **topo).placement.phy2log_LP, time.perf_counter() - t0))
    out: dict[str, list] = {}
    for i, (name, load, ids, _) in enumerate(data):
        load = load.astype(np.float64)
        old_LP = scratch[(i + 1) % len(data)][0]
        E = load.shape[1]
        t0 = time.perf_counter()
        relabeled, _, _ = migrate(load, old_LP, scratch[i][0], Topology(G, old_LP.shape[1] // G, N))
        made = [("from scratch", scratch[i][0], scratch[i][1], ""), ("keep the previous placement", old_LP, 0.0, ""),
                ("even-split migration (relabel)", relabeled, scratch[i][1] + time.perf_counter() - t0, "")]
        prev = Placement(old_LP, G, E, N, ids)
        for label, budget in BUDGETS:
            t0 = time.perf_counter()
            r = plan(traces[i], dispatch=rule, previous=prev, budget=budget, **topo)
            made.append((f"from previous, {label}", r.solution.phy2log_LP, time.perf_counter() - t0,
                         r.info["migration"]["method"]))
        for method, phy, seconds, chosen in made:
            moves = int(count_moves(old_LP, phy, G, E).sum())
            out.setdefault(method, []).append((_served(phy, load, rule, topo, ids), moves, chosen, seconds))
        print(f"  {rule.path}: {name} done", flush=True)
    return out


def _table(out: dict) -> str:
    header = ["method", "served median (max)", "worst workload: median / scratch, max / scratch",
              "worst workload: summed busiest / keep", "layers worse than keep", "moves mean (max)",
              "method chosen", "s (median)"]
    scratch, keep = out["from scratch"], out["keep the previous placement"]
    rows = []
    for method, recs in out.items():
        imb = np.concatenate([imbalance(r[0]) for r in recs])
        med = max(np.median(imbalance(r[0])) / np.median(imbalance(s[0])) for r, s in zip(recs, scratch))
        mx = max(imbalance(r[0]).max() / imbalance(s[0]).max() for r, s in zip(recs, scratch))
        vs_keep = max(r[0].max(axis=1).sum() / k[0].max(axis=1).sum() for r, k in zip(recs, keep))
        worse = sum(int((r[0].max(axis=1) > k[0].max(axis=1) * (1 + 1e-12)).sum()) for r, k in zip(recs, keep))
        moves = [r[1] for r in recs]
        chosen = Counter(r[2] for r in recs if r[2])
        rows.append([method, f"{np.median(imb):.4f} ({imb.max():.4f})", f"{med:.4f} / {mx:.4f}", f"{vs_keep:.4f}",
                     f"{worse} of {imb.size}", f"{np.mean(moves):.0f} ({max(moves)})",
                     ", ".join(f"{k} x{v}" for k, v in sorted(chosen.items())) or "-",
                     f"{np.median([r[3] for r in recs]):.2f}"])
    return format_table(header, rows)


def main(args, data_source, page: str, cmd: str) -> None:
    """Run the part on data_source = (workloads, description); with args.write_docs write docs/results/<page>.md."""
    data, source = data_source
    topo = dict(num_gpus=args.gpus, num_nodes=args.nodes, num_redundant=args.redundant, num_expert_groups=8)
    setup = (f"{args.gpus} GPUs on {args.nodes} nodes, {args.redundant} redundant slots; {len(data)} workloads x "
             f"{len(data[0][1])} MoE layers; data: {source}")
    tables = []
    for label, rule in RULES:
        tables.append((label, rule, _table(_rows_for_rule(rule, data, topo))))
    print(setup)
    for label, rule, table in tables:
        print(f"\nSGLang static, {label} ({rule.name}, path={rule.path}):")
        print(table)
    if args.write_docs:
        body = "".join(f"SGLang static, {label} (`{rule.name}`, path `{rule.path}`):\n\n```\n{table}\n```\n\n"
                       for label, rule, table in tables)
        out = write_results(
            page,
            "# Engines: planning from the placement served now, under SGLang's rules\n\n"
            f"Written by `{cmd}` ({setup}).\n\n"
            "For each workload, the rule-aware plan of the next workload is serving when traffic becomes this "
            "one; every row is planned on this workload and served on it under the rule named above the table "
            "(eplb.dispatch.sglang). `from scratch`: the rule-aware plan with no previous placement; `keep`: the "
            "previous placement as it is; `even-split migration`: the plan from scratch relabelled onto the "
            "previous placement by eplb.migration.migrate, the migration step for even splits, served under this "
            "rule; `from previous`: `eplb.plan(..., previous=..., budget=...)`. "
            "Served: busiest / mean GPU per layer, median (max) over every workload and layer. Worst workload: "
            "the largest ratio over workloads of the row's median (max) over layers to the plan from scratch's, "
            "and of its summed busiest-GPU load over layers to keeping the previous placement. Moves: copies onto "
            "a GPU that did not hold the expert, per workload. Seconds: wall time of one plan on this machine "
            "(2 shared cores; from scratch: the planner; from previous: planner and migration step).\n\n" + body)
        print(f"wrote {out}")
