"""`eplb inspect`: what a placement file holds (and how it balances a trace, if given)."""

from __future__ import annotations

import argparse

import numpy as np

from eplb import stats
from eplb.commands.common import add_command, add_output_flags, format_table, print_json
from eplb.core.placement import check_same_layers
from eplb.errors import EplbError
from eplb.formats import load_placement, load_trace


def add_parser(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "inspect", "summarise a placement file, optionally scored on a trace",
                    "eplb inspect plan.json --trace traces/deepseek.npz")
    p.add_argument("placement", metavar="PLAN", help="eplb placement JSON")
    p.add_argument("--trace", help="score the placement on this trace (summed over windows)")
    add_output_flags(p)
    return p


def run(args) -> int:
    pl = load_placement(args.placement)
    cnt = pl.replica_count_LE
    info = {
        "planner": pl.planner, "num_layers": pl.num_layers, "num_logical_experts": pl.num_logical_experts,
        "num_gpus": pl.num_gpus, "num_nodes": pl.num_nodes, "num_slots": pl.num_slots,
        "slots_per_gpu": pl.slots_per_gpu, "layer_ids": pl.layer_ids.tolist(),
        "max_replicas": int(cnt.max()), "experts_with_replicas_per_layer_median": float(np.median((cnt > 1).sum(1))),
        "dispatch_weights": pl.dispatch_weights_LP is not None, "metrics": pl.metrics,
    }
    if args.trace:
        trace = load_trace(args.trace)
        if trace.num_layers != pl.num_layers or trace.num_logical_experts != pl.num_logical_experts:
            raise EplbError(f"trace {args.trace} is {trace.num_layers} layers x {trace.num_logical_experts} experts, "
                            f"the placement {pl.num_layers} x {pl.num_logical_experts}")
        check_same_layers(pl, trace.layer_ids, placement_name=f"placement {args.placement}",
                          trace_name=f"trace {args.trace}")
        info["scored_on"] = args.trace
        info["score"] = stats.evaluate(pl, trace.total()).summary()
    if args.json:
        print_json(info)
        return 0
    if args.quiet:
        return 0
    rows = [[k, v] for k, v in info.items() if k not in ("layer_ids", "metrics", "score")]
    rows.append(["layer_ids", f"{pl.layer_ids[0]}..{pl.layer_ids[-1]}" if pl.num_layers else "-"])
    print(format_table(["field", "value"], rows))
    if "score" in info:
        s = info["score"]
        print(f"on {args.trace}: max/mean GPU median {s['imbalance']['median']:.4f}, max {s['imbalance']['max']:.4f}; "
              f"/bound median {s['bound_ratio']['median']:.4f}; balancedness {s['balancedness']:.4f}")
    return 0
