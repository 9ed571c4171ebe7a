"""`eplb backtest`: plan on past windows only and score the windows that follow."""

from __future__ import annotations

import argparse

from eplb.commands.common import (
    add_command,
    add_output_flags,
    add_topology_arguments,
    check_output_path,
    check_suffix,
    format_table,
    json_text,
    positive_int,
    print_json,
)
from eplb.commands.plan import objective_from_args, parse_settings
from eplb.commands.simulate import add_time_scoring_arguments
from eplb.core.outputs import write_text
from eplb.errors import EplbError
from eplb.evaluate.backtest import DISPATCH, backtest, leave_one_out
from eplb.formats import load_history, load_trace
from eplb.stats.loads import AGGREGATIONS
from planners.api import planner_names


def add_parser(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "backtest", "replay traces: plan on the past, score held-out windows",
                    "eplb backtest traces/deepseek.npz --gpus 32 --planner greedy --planner robust "
                    "--interval 4 --history 8")
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help="trace files; several are stacked in order (or, with --leave-one-out, "
                        "are the workloads)")
    add_topology_arguments(p)
    p.add_argument("--planner", "-p", action="append", choices=planner_names(), metavar="NAME",
                   help=f"planner to test, repeatable ({', '.join(planner_names())}; default greedy)")
    p.add_argument("--interval", type=positive_int,
                   help="windows served by each plan before the next rebalance (default 1)")
    p.add_argument("--history", type=positive_int,
                   help="past windows each plan looks at (default: all past windows)")
    p.add_argument("--leave-one-out", action="store_true",
                   help="plan on all trace files but one, score on the one left out, for each file")
    p.add_argument("--dispatch", action="append", choices=(*DISPATCH, "time"), metavar="POLICY",
                   help=f"dispatch policies to score, repeatable ({', '.join(DISPATCH)}, and time with "
                        f"--objective time; default all)")
    p.add_argument("--aggregate", default="sum", choices=AGGREGATIONS,
                   help="how history windows become the planning load (default sum; 'window' sums the "
                        "newest --history windows, which is what sum over --history does)")
    p.add_argument("--no-oracle", action="store_true",
                   help="skip the oracle plans made on each scored window (no forecast gap; faster)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="planner setting, e.g. --set quantile=0.9 (repeatable; applies to every planner)")
    add_time_scoring_arguments(p, "plans balance token loads (default) or modeled per-GPU time (needs --model and "
                                  "--hardware); with time every window is also scored in modeled step time")
    p.add_argument("--output", "-o", metavar="FILE",
                   help="also write the results as JSON (what --json prints) to FILE, for `eplb plot backtest`")
    add_output_flags(p)
    return p


def run(args) -> int:
    if args.output is not None:  # before the backtest, which plans many times
        check_output_path(args.output, "the backtest results",
                          inputs=[("TRACE", t) for t in args.traces] + [("--hardware", args.hardware)])
        check_suffix(args.output, (".json",), "JSON")
    if args.leave_one_out:
        # Each fold plans on all other workloads: there is no replay order to step through.
        given = [f"--{k} {v}" for k, v in (("interval", args.interval), ("history", args.history)) if v is not None]
        if given:
            raise EplbError(f"{' and '.join(given)} apply to sequential backtests; --leave-one-out plans each "
                            f"fold on all other workloads: drop {' and '.join(g.split()[0] for g in given)}")
    aggregate = args.aggregate
    if aggregate == "window":
        # A plan sees only its --history windows, so summing the newest N of them is "sum".
        if args.history is None or args.leave_one_out:
            raise EplbError("--aggregate window sums the newest windows each plan sees: give them with "
                            "--history N (sequential mode), or use --aggregate sum")
        aggregate = "sum"
    planners = args.planner or ["greedy"]
    objective = objective_from_args(args)
    if args.hardware is not None and objective == "tokens":
        raise EplbError("--hardware scores backtests in modeled time for plans made for it: add --objective time")
    dispatch = tuple(dict.fromkeys(args.dispatch)) if args.dispatch else None
    common = dict(num_gpus=args.gpus, num_nodes=args.nodes, num_redundant=args.redundant,
                  slots_per_gpu=args.slots_per_gpu, dispatch=dispatch, settings=parse_settings(args.set),
                  aggregate=aggregate, oracle=not args.no_oracle, quiet=args.quiet or args.json,
                  objective=objective, batches_per_window=args.batches)
    results = []
    if args.leave_one_out:
        workloads = [load_trace(p) for p in args.traces]
        for name in planners:
            results.append(leave_one_out(workloads, planner=name, labels=args.traces, **common))
    else:
        trace = load_history(args.traces)
        for name in planners:
            results.append(backtest(trace, planner=name, interval=args.interval or 1, history=args.history, **common))
    if args.output is not None:
        write_text(args.output, json_text({"results": [r.summary() for r in results]}), what="the backtest results")
    if args.json:
        print_json({"results": [r.summary() for r in results]})
        return 0
    if args.quiet:
        return 0
    first = results[0]
    mode = ("leave-one-out over " + f"{len(args.traces)} workloads" if args.leave_one_out
            else f"every {first.interval} window(s), history {first.history or 'all past'}")
    print(f"backtest ({mode}); {first.num_gpus} GPUs, {first.num_slots} slots; "
          f"{len(first.windows)} held-out window(s), medians over them")
    rows = []
    for r in results:
        s = r.summary()["median"]
        for d in r.dispatch:
            fg = s["forecast_gap"][d]
            row = [r.planner, d, s["imbalance"][d], s["imbalance_sum"][d], s["bound_ratio"][d],
                   "n/a" if fg is None else f"{100 * fg:.2f}%", f"{100 * s['optimisation_gap'][d]:.2f}%"]
            if r.timed:
                sec = s["step_seconds"][d]
                row.append("n/a" if sec is None else f"{1e3 * sec:.3f}")
            rows.append(row)
    print(format_table(["planner", "dispatch", "max/mean", "sum max/mean", "max/bound", "forecast gap",
                        "optimisation gap"] + (["step ms"] if first.timed else []), rows))
    for r in results:
        secs = [p.seconds for p in r.plans]
        print(f"{r.planner}: {len(r.plans)} plan(s), median {1e3 * sorted(secs)[len(secs) // 2]:.1f} ms per plan")
        for note in r.notes:
            print(f"  note: {note}")
    print("max/mean: busiest/mean GPU (median over layers); forecast gap: vs a plan made on the scored "
          "window itself; optimisation gap: plan vs lower bound on its own planning load")
    if first.timed:
        t = first.time
        print(f"planned for modeled time; step ms: modeled MoE time per step ({t['model']} on {t['hardware']}, "
              f"{t['phase']}, {t['batch_tokens']:,} tokens per step), median over windows; batches: {t['how']}")
    return 0
