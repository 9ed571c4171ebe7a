"""`eplb plot KIND`: figures (PNG, SVG or PDF by file extension) of traces, plans, backtests and replays."""

from __future__ import annotations

import argparse
import os

import numpy as np

from eplb import stats
from eplb.commands.common import REDUNDANT_HELP, add_command, add_output_flags, check_output_path, print_json
from eplb.core.placement import check_same_layers, contiguous_placement
from eplb.core.progress import progress
from eplb.errors import EplbError
from eplb.evaluate import plot, timeline
from eplb.evaluate.backtest import DISPATCH
from eplb.formats import load_history, load_placement, load_trace, read_json_file, read_replay
from eplb.planning.front_door import plan, size_topology
from planners.api import planner_names

EXAMPLES = {
    "heatmap": "eplb plot heatmap traces/deepseek.npz -o heatmap.png",
    "balance": "eplb plot balance traces/deepseek.npz --gpus 32 --planner greedy -o balance.png",
    "replicas": "eplb plot replicas plan.json --trace traces/deepseek.npz -o replicas.svg",
    "backtest": "eplb backtest traces/deepseek.npz --gpus 32 -p greedy -p robust --interval 8 --history 8 "
                "-q -o bt.json && eplb plot backtest bt.json -o backtest.png",
    "replay": "eplb replay traces/deepseek.npz --gpus 32 --redundant 32 -o replay.npz && "
              "eplb plot replay replay.npz -o replay.png",
}


def add_parser(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "plot", "draw figures: expert-load heatmap, GPU balance, replica map, backtest, replay",
                    EXAMPLES["balance"])
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True)

    def kind(name: str, help: str) -> argparse.ArgumentParser:
        k = add_command(kinds, name, help, EXAMPLES[name])
        k.add_argument("--output", "-o", required=True, help="figure file: .png, .svg or .pdf")
        k.add_argument("--title", help="figure title (default: a summary of what is shown)")
        add_output_flags(k)
        k.set_defaults(_parser=k)          # usage errors name "eplb plot KIND"
        return k

    k = kind("heatmap", "layer x expert load relative to the layer mean (log colour scale)")
    k.add_argument("traces", nargs="+", metavar="TRACE", help="trace files; several are stacked (windows summed)")

    k = kind("balance", "busiest / mean GPU load per layer: contiguous vs planners (and placement files)")
    k.add_argument("traces", nargs="+", metavar="TRACE", help="trace files (windows summed for the load)")
    k.add_argument("--gpus", "-g", type=int, help="GPUs to plan for (needed with --planner)")
    k.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    k.add_argument("--redundant", type=int, help=REDUNDANT_HELP)
    k.add_argument("--planner", "-p", action="append", default=[], choices=planner_names(),
                   help="planner to compare (repeatable; default greedy)")
    k.add_argument("--placement", action="append", default=[], metavar="PLAN",
                   help="also compare this eplb placement file (repeatable)")

    k = kind("replicas", "replicas per expert and layer, and one layer's slots per GPU")
    k.add_argument("placement", metavar="PLAN", help="eplb placement JSON")
    k.add_argument("--trace", help="weigh slots by this trace's load (windows summed)")
    k.add_argument("--layer", type=int, help="MoE layer index (0-based) for the per-GPU panel "
                                            "(default: the layer with the hottest expert, or 0)")

    k = kind("backtest", "balance per scored window for each planner, with rebalance points and moves")
    k.add_argument("result", metavar="RESULT",
                   help="the file `eplb backtest ... -o FILE` wrote (what --json prints: {\"results\": [...]}); or "
                        "explicit series {\"series\": [{\"name\", \"imbalance\": [T], \"rebalance_at\": [R], "
                        "\"moves\": [R]}, ...]}")
    k.add_argument("--dispatch", default="even", choices=DISPATCH, metavar="POLICY",
                   help=f"which scored dispatch policy to draw ({', '.join(DISPATCH)}; default even)")
    k.add_argument("--window-label", help="x-axis label (default: which trace window is scored window 0)")

    k = kind("replay", "busiest / mean GPU per served window of a replay, rebalancing moments, references")
    k.add_argument("result", metavar="REPLAY", help="the .npz `eplb replay ... -o` wrote")
    k.add_argument("--rule", help="dispatch rule to draw (default: the first the replay scored)")
    return p


def _load_backtest_json(path: str, dispatch: str):
    """Series and the parsed JSON of a backtest file (see the RESULT help)."""
    try:
        data = read_json_file(path, "backtest file")
    except EplbError as exc:
        raise EplbError(f"{exc}; plot the JSON that `eplb backtest ... --json` printed, saved to a file") from None
    return timeline.timeline_from_json(data, dispatch, source=path), data


def _backtest_labels(data, dispatch: str) -> tuple[str, str]:
    """x- and y-axis labels for `eplb backtest --json` output (generic ones for plain series)."""
    results = data.get("results") if isinstance(data, dict) else None
    if not results:
        return "window", "busiest GPU / mean GPU load"
    first = results[0]
    metric = f"busiest / mean GPU load,\nmedian over layers ({dispatch} dispatch)"
    if first.get("mode") == "leave-one-out":
        return "held-out workload window", metric
    w0 = first["per_window"][0].get("window")
    return f"scored window (0 = trace window {w0})", metric


def _check_layer_ids(plan_path, pl, trace, trace_path) -> None:
    """Same shape is not enough: rows of another model's layers would be scored silently."""
    check_same_layers(pl, trace.layer_ids, placement_name=f"placement {plan_path}", trace_name=str(trace_path))


def _heatmap(args):
    trace = load_history(args.traces)
    total = trace.total()
    info = {"hot_ratio_median": float(np.median(total.max(1) / np.maximum(total.mean(1), 1e-12)))}
    return plot.expert_heatmap(trace, title=args.title), info


def _balance(args):
    trace = load_history(args.traces)
    load = trace.total().astype(np.float64)
    files = [load_placement(f) for f in args.placement]
    num_gpus = args.gpus if args.gpus is not None else (files[0].num_gpus if files else None)
    if num_gpus is None:
        raise EplbError("give --gpus (or a --placement file to take the GPU count from)")
    planners = args.planner or ([] if files else ["greedy"])
    topo = size_topology(trace.num_logical_experts, num_gpus=num_gpus, num_nodes=args.nodes,
                         num_redundant=args.redundant, num_layers=trace.num_layers)
    placements = {"contiguous": contiguous_placement(trace.num_logical_experts, topo, trace.layer_ids)}
    for name in progress(planners, desc="planning", enabled=None if not args.quiet else False):
        placements[name] = plan(trace, topology=topo, planner=name).placement
    for path, pl in zip(args.placement, files):
        if pl.num_layers != trace.num_layers or pl.num_logical_experts != trace.num_logical_experts:
            raise EplbError(f"placement {path} is {pl.num_layers} layers x {pl.num_logical_experts} experts, "
                            f"the trace {trace.num_layers} x {trace.num_logical_experts}")
        _check_layer_ids(path, pl, trace, args.traces[0])
        placements[os.path.basename(path)] = pl
    fig = plot.gpu_load_comparison(load, placements, layer_ids=trace.layer_ids, title=args.title)
    info = {"imbalance_median": {n: float(np.median(stats.imbalance(p.gpu_loads(load))))
                                 for n, p in placements.items()}}
    return fig, info


def _replicas(args):
    pl = load_placement(args.placement)
    load = None
    if args.trace:
        trace = load_trace(args.trace)
        _check_layer_ids(args.placement, pl, trace, args.trace)
        load = trace.total()
    fig = plot.replica_map(pl, load, layer=args.layer, title=args.title)
    return fig, {"max_replicas": int(pl.replica_count_LE.max())}


def _backtest(args):
    series, data = _load_backtest_json(args.result, args.dispatch)
    xlabel, ylabel = _backtest_labels(data, args.dispatch)
    fig = timeline.backtest_timeline(series, window_label=args.window_label or xlabel, metric_label=ylabel,
                                 title=args.title)
    return fig, {"series": [s.name for s in series],
                 "imbalance_mean": {s.name: float(s.imbalance_T.mean()) for s in series}}


def _replay(args):
    arrays, meta = read_replay(args.result)
    fig = timeline.replay_timeline(arrays, meta, rule=args.rule, title=args.title)
    return fig, {"rule": args.rule or meta["rules"][0], "applied": int(arrays["applied_T"].sum())}


KINDS = {"heatmap": _heatmap, "balance": _balance, "replicas": _replicas, "backtest": _backtest, "replay": _replay}
"""What each KIND computes before plot draws it: (figure, numbers for --json)."""


def _inputs(args) -> list[tuple[str, str]]:
    """Every file a plot kind reads, as (flag, path): -o must name none of them."""
    given = [("TRACE", t) for t in getattr(args, "traces", None) or []]
    given += [("--placement", t) for t in getattr(args, "placement", None) or [] if args.kind == "balance"]
    for flag, name in (("PLAN", "placement"), ("--trace", "trace"), ("RESULT", "result")):
        value = getattr(args, name, None)
        if isinstance(value, str):
            given.append((flag, value))
    return given


def run(args) -> int:
    out = args.output
    check_output_path(out, "the figure", inputs=_inputs(args))  # both before the planning some kinds do
    plot.check_figure_path(out)
    fig, numbers = KINDS[args.kind](args)
    plot.save(fig, out)
    info = {"kind": args.kind, "output": out, **numbers, "bytes": os.path.getsize(out)}
    if args.json:
        print_json(info)
    elif not args.quiet:
        print(f"wrote {out} ({info['bytes'] / 1024:.0f} KiB)")
    return 0
