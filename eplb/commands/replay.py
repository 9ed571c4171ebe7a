"""`eplb replay`: serve a trace window by window under an online policy, as an engine would."""

from __future__ import annotations

import argparse

from eplb.commands.common import (
    add_command,
    add_output_flags,
    add_topology_arguments,
    check_output_path,
    check_suffix,
    format_table,
    positive_int,
    print_json,
)
from eplb.commands.plan import objective_from_args, parse_settings
from eplb.commands.simulate import add_time_scoring_arguments, cost_from_args
from eplb.dispatch.cost import TimeObjective
from eplb.evaluate.replay import Scoring, replay
from eplb.formats import load_trace, write_replay
from eplb.planning.front_door import size_topology
from eplb.serving.policy import POLICIES, get_policy


def add_parser(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "replay", "replay a trace in time order: serve, observe, rebalance; score against "
                                   "the static plan and hindsight",
                    "eplb replay traces/deepseek.npz --gpus 32 --redundant 32 -o replay.npz && "
                    "eplb plot replay replay.npz -o replay.png")
    p.add_argument("trace", metavar="TRACE", help="trace file (windows in time order; per-token traces with "
                                                   "--tokens-per-window)")
    add_topology_arguments(p)
    p.add_argument("--tokens-per-window", type=positive_int, metavar="K",
                   help="cut the trace's per-token expert choices into windows of K tokens (default: its windows)")
    p.add_argument("--warmup", type=positive_int, metavar="W",
                   help="windows of history only before serving starts (default: half of them)")
    p.add_argument("--policy", default="adaptive", choices=list(POLICIES),
                   help=f"online policy ({', '.join(POLICIES)}; default adaptive)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="policy setting, e.g. --set move_cost=0.5 or --policy window --set window=all (repeatable)")
    p.add_argument("--delay", type=int, default=1,
                   help="windows a decision's migration takes before the new placement serves (default 1)")
    p.add_argument("--bytes-per-expert", type=positive_int, help="size of one expert's weights, to count bytes moved")
    p.add_argument("--rule", action="append", metavar="RULE",
                   help="dispatch rule to score, repeatable (eplb.dispatch rules; default even and resplit)")
    p.add_argument("--plan-for", choices=("even", "resplit"), default="even",
                   help="dispatch rule the engine serves, which the warm-up plan and the policy plan for (default "
                        "even; resplit: searched under per-batch re-split scores, eplb.planning.resplit_repair)")
    p.add_argument("-o", "--output", help="write the served windows' placements, shares, counts and metrics (.npz)")
    add_time_scoring_arguments(p, "what the initial plan, the policy and hindsight balance: token loads (default) "
                                  "or modeled per-GPU time (needs --model and --hardware); with --hardware every "
                                  "window is also scored in modeled step time, the per-batch time dispatch included")
    add_output_flags(p)
    return p


def _settings(items: list[str]) -> dict:
    out = parse_settings(items)
    # "window=all" is the whole history (None in Python).
    return {k: (None if isinstance(v, str) and v.lower() in ("all", "none") else v) for k, v in out.items()}


def run(args) -> int:
    if args.output is not None:  # before the replay, which takes a while; -o naming an input is refused
        check_output_path(args.output, "the replay", inputs=[("TRACE", args.trace), ("--hardware", args.hardware)])
        check_suffix(args.output, (".npz",), "a replay (.npz)")
    settings = _settings(args.set)
    get_policy(args.policy, settings)                           # a bad setting fails before the trace is read
    objective = objective_from_args(args)
    timed = None
    if args.hardware is not None:
        timed = objective if objective != "tokens" else TimeObjective(cost_from_args(args), args.batch_tokens,
                                                                      args.phase or "decode")
    trace = load_trace(args.trace)
    topo = size_topology(trace.num_logical_experts, num_gpus=args.gpus, num_nodes=args.nodes,
                         num_redundant=args.redundant, slots_per_gpu=args.slots_per_gpu, num_layers=trace.num_layers)
    rules = tuple(dict.fromkeys(args.rule)) if args.rule else ("even", "resplit")
    scoring = Scoring(rules, time=timed, batches_per_window=args.batches)
    result = replay(trace, topology=topo, policy=args.policy, settings=settings, warmup=args.warmup,
                    tokens_per_window=args.tokens_per_window, delay=args.delay, scoring=scoring,
                    bytes_per_expert=args.bytes_per_expert, objective=objective, plan_for=args.plan_for)
    if args.output is not None:  # last thing that can fail: a failed run leaves -o as it was
        write_replay(result, args.output)
    s = result.summary()
    if args.json:
        print_json(s)
        return 0
    if args.quiet:
        return 0
    print(f"replay of {args.trace}: {result.notes[0]}; {s['warmup']} warm-up window(s), {s['served_windows']} served; "
          f"{s['num_gpus']} GPUs, {s['num_slots']} slots; policy {s['policy_name']}, delay {s['delay']}; "
          f"{result.notes[1]}")
    rows = []
    for run_name in ("policy", "static", "hindsight"):
        for rule in s["rules"]:
            o = s[run_name][rule]
            row = [s["policy_name"] if run_name == "policy" else run_name, rule, o["median"], o["p95"], o["max"],
                   o["balancedness"]]
            if "step_seconds" in o:
                row += [f"{1e3 * o['step_seconds']['median']:.3f}", f"{1e3 * o['step_seconds']['p95']:.3f}"]
            rows.append(row)
    head = ["run", "dispatch", "median", "p95", "max", "balancedness"]
    print(format_table(head + (["step ms median", "step ms p95"] if s["time"] else []), rows))
    moved = (f"{s['moves']:,} moves ({s['moves_per_window']:,.1f} per served window, "
             f"{100 * s['moves_per_window_share_of_slots']:.2f}% of the {s['num_slots'] * s['num_layers']:,} slots "
             f"over all layers), {s['rounds']} migration rounds")
    if s["bytes"] is not None:
        moved += f", {s['bytes'] / 2**30:,.2f} GiB"
    print(f"{s['decisions']} decision(s): {moved}; replay {s['seconds']:.1f} s (policy {s['policy_seconds']:.1f} s)")
    print("median / p95 / max: busiest / mean GPU over every (served window, layer); static: the warm-up plan kept; "
          "hindsight: greedy planned on each served window" + (" (all planned for modeled time)"
                                                                if s["objective"] == "time" else ""))
    if s["time"]:
        t = s["time"]
        print(f"step ms: modeled MoE time per step ({t['model']} on {t['hardware']}, {t['phase']}, "
              f"{t['batch_tokens']:,} tokens per step), median / p95 over served windows; batches: {t['how']}")
    if args.output:
        print(f"wrote {args.output}")
    return 0
