"""`eplb stats`: skew of a trace per layer, and what contiguous placement would cost."""

from __future__ import annotations

import argparse

import numpy as np

from eplb import stats
from eplb.commands.common import REDUNDANT_HELP, add_command, add_output_flags, format_table, positive_int, print_json
from eplb.core.placement import contiguous_placement
from eplb.formats import load_history
from eplb.planning.front_door import size_topology

DEFAULT_GPUS = 32
"""GPUs of the GPU-level figures when --gpus is not given (fewer for a model with fewer experts)."""


def add_parser(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "stats", "skew statistics and lower bounds of router traces",
                    "eplb stats traces/deepseek.npz --gpus 32")
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace files; several are stacked as history")
    p.add_argument("--gpus", "-g", type=positive_int,
                   help=f"GPUs for the GPU-level figures (default: {DEFAULT_GPUS}, or the number of experts if "
                        f"fewer)")
    p.add_argument("--redundant", type=int, help="for the lower bound: " + REDUNDANT_HELP)
    p.add_argument("--per-layer", action="store_true", help="one row per layer instead of a summary")
    add_output_flags(p)
    return p


def run(args) -> int:
    trace = load_history(args.traces)
    load = trace.total().astype(np.float64)
    L, E = load.shape
    # The default fits any trace: a model of 8 experts is not shown on 32 GPUs it could not fill.
    num_gpus = args.gpus if args.gpus is not None else min(DEFAULT_GPUS, E)
    # As in eplb.plan: what cannot be filled, or would not fit in memory, is refused before [L, P] arrays.
    topo = size_topology(E, num_gpus=num_gpus, num_redundant=args.redundant, num_layers=L)
    base = contiguous_placement(E, topo, trace.layer_ids)
    contiguous = stats.imbalance(base.gpu_loads(load))
    mean_gpu = load.sum(axis=1) / topo.num_gpus
    # Idle layers count as balanced (1), like every other column (lb / 1 would give 0).
    bound = np.where(mean_gpu > 0,
                     stats.lower_bound(load, topo.num_gpus, topo.num_slots) / np.where(mean_gpu > 0, mean_gpu, 1), 1.0)
    hot, gini = stats.hot_ratio(load), stats.gini(load)
    per_window = trace.counts_TLE.astype(np.float64)
    win_hot = np.median(stats.hot_ratio(per_window), axis=1) if trace.num_windows > 1 else None
    columns = {"hot/mean": hot, "gini": gini, "contiguous max/mean": contiguous, "bound/mean": bound}
    summary = {
        "num_windows": trace.num_windows, "num_layers": L, "num_experts": E,
        "tokens": int(load.sum()), "gpus": topo.num_gpus, "slots": topo.num_slots, "meta": trace.meta,
        "per_layer": {"layer_ids": trace.layer_ids.tolist(), **{k: v.tolist() for k, v in columns.items()}},
        "median": {k: float(np.median(v)) for k, v in columns.items()},
        "max": {k: float(np.max(v)) for k, v in columns.items()},
    }
    if win_hot is not None:
        summary["window_hot_ratio_median"] = win_hot.tolist()
    if args.json:
        print_json(summary)
        return 0
    if args.quiet:
        return 0
    m = trace.meta
    print(f"{L} MoE layers x {E} experts, {trace.num_windows} window(s), {int(load.sum()):,} token-slots; "
          f"model {m.get('model')}, synthetic={m.get('synthetic')}, source: {m.get('source')}")
    if args.per_layer:
        rows = [[int(trace.layer_ids[i]), *(float(v[i]) for v in columns.values())] for i in range(L)]
        print(format_table(["layer", *columns], rows))
    else:
        rows = [[k, float(np.min(v)), float(np.median(v)), float(np.max(v))] for k, v in columns.items()]
        print(format_table(["per layer", "min", "median", "max"], rows))
    chosen = "" if args.gpus is not None else " (default; set --gpus)"
    print(f"GPU figures for {topo.num_gpus} GPUs{chosen} and {topo.num_slots} slots; bound = lower bound on the "
          f"busiest GPU")
    return 0
