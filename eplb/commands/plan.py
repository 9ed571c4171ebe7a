"""`eplb plan`: plan an expert placement from router traces and write it for an engine."""

from __future__ import annotations

import argparse

from eplb.commands.common import (
    add_command,
    add_output_flags,
    check_output_path,
    format_table,
    positive_int,
    print_json,
)

FORMATS = ("eplb", "sglang", "vllm", "trtllm")


def add_parser(sub) -> argparse.ArgumentParser:
    from eplb.planning import planner_names

    p = add_command(sub, "plan", "plan an expert-to-GPU placement from router traces",
                    "eplb plan traces/deepseek.npz --gpus 16 -o plan.json")
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help="trace files (eplb .npz, .npy, SGLang JSON/.pt); several = history, oldest first")
    p.add_argument("--gpus", "-g", type=positive_int, required=True, help="expert-parallel GPUs (ranks)")
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes the GPUs are spread over (default 1)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--redundant", type=int, help="redundant slots in total (default: one per GPU)")
    size.add_argument("--slots-per-gpu", help="physical slots per GPU (instead of --redundant), or 'auto': "
                                               "as many as fit in memory next to the KV cache (capacity options)")
    # robust is the CLI default: it wins on held-out traffic (README, "Robust planning"); the
    # API's eplb.plan() keeps greedy as its default because serving loops call it per rebalance.
    # Under an engine rule whose shares depend on the layout (SGLang's), rule-aware is the default.
    p.add_argument("--planner", "-p", default=None, choices=planner_names(),
                   help="algorithm (default robust: plans against every window of the history; "
                        "rule-aware with --engine sglang)")
    from eplb.dispatch import ENGINES

    p.add_argument("--engine", "-e", choices=list(ENGINES),
                   help="engine that serves the plan: the report scores it under that engine's dispatch rule "
                        "(docs/engines.md); default the engine of --format")
    p.add_argument("--dispatch", metavar="MODE",
                   help="the engine's dispatch mode (sglang: static (default) or dynamic; vllm, trtllm: even)")
    p.add_argument("--aggregate", default="sum", choices=["sum", "mean", "last", "window", "ema"],
                   help="how windows become the planning load (default sum)")
    p.add_argument("--window", type=positive_int, help="with --aggregate window: newest windows to sum")
    p.add_argument("--alpha", type=float, help="with --aggregate ema: weight of the newest window (default 0.3)")
    p.add_argument("--expert-groups", "--groups", type=positive_int,
                   help="expert groups of the router (default: from the trace)")
    p.add_argument("--output", "-o", help="write the placement here")
    p.add_argument("--format", "-f", choices=FORMATS,
                   help="file format of --output: eplb JSON, SGLang --init-expert-location JSON, "
                        "vLLM .pt tensors, TensorRT-LLM load_balancer YAML (default eplb)")
    mig = p.add_argument_group("migration (see eplb.migration)")
    mig.add_argument("--previous", metavar="OLD.json",
                     help="placement now served (eplb JSON): keep its replicas in place, report moves")
    mig.add_argument("--max-moves", type=int, metavar="K", help="with --previous: copy at most K experts in total")
    mig.add_argument("--max-moves-per-gpu", type=int, metavar="K",
                     help="with --previous: at most K copies onto any GPU")
    mig.add_argument("--move-cost", type=float, default=0.0, metavar="C",
                     help="with --previous: a copy must lower its layer's busiest GPU by C x mean GPU load")
    mig.add_argument("--bytes-per-expert", type=int, metavar="B",
                     help="size of one expert's weights, to report bytes moved")
    mig.add_argument("--span-cost", type=float, metavar="C",
                     help="with --previous, --nodes > 1 and expert groups: spreading a group onto one more "
                          "node costs C moves (default 1; 0 ignores node locality)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="planner setting, e.g. --set time_limit=30 (repeatable)")
    from eplb.capacity import add_arguments as add_capacity_arguments

    add_capacity_arguments(p, for_plan=True)
    add_output_flags(p)
    return p


def parse_settings(items: list[str]) -> dict:
    """KEY=VALUE strings into a dict; values parsed as int, float, bool or kept as text."""
    from eplb.errors import EplbError

    out: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise EplbError(f"--set expects KEY=VALUE, got {item!r}")
        value: object = text
        for conv in (int, float):
            try:
                value = conv(text)
                break
            except ValueError:
                pass
        if text.lower() in ("true", "false"):
            value = text.lower() == "true"
        out[key.strip()] = value
    return out


def run(args) -> int:
    import numpy as np

    from eplb.errors import EplbError
    from eplb.planning import plan, planner_settings
    from eplb.stats import window_balancedness
    from eplb.trace import load_history

    # Options that only act together with another one are refused alone, not ignored.
    if args.format is not None and args.output is None:
        raise EplbError(f"--format {args.format} sets the file format of --output: add -o FILE")
    rule, engine = engine_of(args)
    args.format = args.format or (engine if engine and args.output else "eplb")
    if args.planner is None:
        from eplb.planning import _layout_dependent

        args.planner = "rule-aware" if rule is not None and _layout_dependent(rule) else "robust"
    if args.slots_per_gpu != "auto":
        given = [f"--{k.replace('_', '-')}" for k in ("model", "gpu_memory", "context", "concurrency", "expert_dtype")
                 if getattr(args, k) is not None]
        if given:
            raise EplbError(f"{', '.join(given)} size the slots only with --slots-per-gpu auto: add it, or drop them")
    if args.output is not None:
        check_output_path(args.output, "the placement")  # before planning, which may take minutes
    trace = load_history(args.traces)
    if args.window is not None and args.window > trace.num_windows:
        raise EplbError(f"--window {args.window} asks for more windows than the trace holds ({trace.num_windows}): "
                        f"use --window {trace.num_windows} or less (or --aggregate sum for all of them)")
    settings = parse_settings(args.set)
    if (args.quiet or args.json) and "quiet" in planner_settings(args.planner):
        settings.setdefault("quiet", True)  # no progress bar when asked for silence
    if rule is not None:
        ilp_for_engine(args, settings, rule, engine)
    slots = None
    capacity = None
    if args.slots_per_gpu == "auto":
        from eplb.capacity import slots_from_args

        capacity = slots_from_args(args, trace.num_logical_experts)
        slots = capacity.slots_per_gpu
    elif args.slots_per_gpu is not None:
        try:
            slots = int(args.slots_per_gpu)
        except ValueError:
            raise EplbError(f"--slots-per-gpu must be a whole number, got {args.slots_per_gpu!r}") from None
    previous = None
    if args.previous:
        from eplb.placement import Placement

        if args.span_cost is not None and (args.nodes == 1
                                           or not (args.expert_groups or trace.meta.get("num_expert_groups"))):
            raise EplbError(f"--span-cost {args.span_cost:g} prices spreading an expert group onto one more node, so "
                            f"it needs --nodes > 1 and expert groups (--expert-groups, or the trace's "
                            f"num_expert_groups); give both or drop --span-cost")
        previous = Placement.load(args.previous)
        if slots is None and args.redundant is None:
            slots = previous.slots_per_gpu  # same slots as the placement being replaced
    result = plan(
        trace, num_gpus=args.gpus, num_nodes=args.nodes, num_redundant=args.redundant, slots_per_gpu=slots,
        planner=args.planner, aggregate=args.aggregate, window=args.window, alpha=args.alpha,
        num_expert_groups=args.expert_groups, settings=settings, previous=previous,
        max_moves=args.max_moves, max_moves_per_gpu=args.max_moves_per_gpu, move_cost=args.move_cost,
        bytes_per_expert=args.bytes_per_expert, span_cost=args.span_cost, dispatch=rule,
    )
    if not result.load_LE.any():  # any placement "balances" nothing: do not write one as if it did
        which = "the trace" if args.aggregate == "sum" else f"the planning load (--aggregate {args.aggregate})"
        raise EplbError(f"{which} holds no tokens (every count is zero): there is no load to balance; "
                        f"check the collector, or plan on windows with traffic")
    migration = result.info.get("migration")
    if args.output:
        write_placement(result.placement, args.output, args.format, trace.meta)
    window_bal = None
    if trace.num_windows > 1:
        # Each window alone (robust plans for these; the summed-load columns hide them).
        from planners.contiguous import contiguous_placement

        scored = [("contiguous", contiguous_placement(result.placement))]
        scored += [("previous", previous)] if previous is not None else []
        window_bal = {name: window_balancedness(p, trace.counts_TLE)
                      for name, p in scored + [("plan", result.placement)]}
    if args.json:
        out = result.summary()
        out["window_balancedness"] = None if window_bal is None else {k: v.tolist() for k, v in window_bal.items()}
        out["output"] = args.output
        out["format"] = args.format
        out["capacity"] = capacity.to_dict() if capacity else None
        out["moves"] = migration["moves"] if migration else None
        out["bytes_moved"] = migration["bytes"] if migration else None
        print_json(out)
        return 0
    if args.quiet:
        return 0
    pl = result.placement
    print(f"{trace.num_layers} MoE layers x {trace.num_logical_experts} experts, {trace.num_windows} window(s); "
          f"{pl.num_gpus} GPUs on {pl.num_nodes} node(s), {pl.num_slots} slots "
          f"({pl.num_slots - pl.num_logical_experts} redundant, {pl.slots_per_gpu} per GPU)")
    if capacity:
        print(f"slots per GPU auto: {capacity.slots_per_gpu} fit on {capacity.deployment.gpu_memory / 2**30:.1f} GiB "
              f"next to {capacity.concurrency:,} sequences x {capacity.deployment.context:,} tokens "
              f"({capacity.free_bytes_per_gpu / 2**30:.2f} GiB left per GPU; see `eplb capacity`)")
    rows = []
    reports = [("contiguous (no EPLB)", result.before)]
    if previous is not None:
        from eplb.stats import evaluate

        reports.append((f"previous ({args.previous})", evaluate(previous, result.load_LE)))
    own = " (plan's weights)" if pl.dispatch_weights_LP is not None else " (even split)"
    reports.append((f"{result.planner}" + (own if result.served is not None else ""), result.after))
    per_window = list(window_bal.values()) if window_bal else [None] * len(reports)
    if result.served is not None:
        reports.append((f"{result.planner}, served by {engine} ({result.dispatch})", result.served))
        per_window.append(None)
    for (name, rep), wb in zip(reports, per_window):
        imb, br = rep.imbalance_L, rep.bound_ratio_L
        rows.append([name, float(np.min(imb)), float(np.median(imb)), float(np.max(imb)),
                     float(np.median(br)), float(np.max(br)), rep.balancedness]
                    + ([] if not window_bal else ["" if wb is None else float(np.median(wb)),
                                                  "" if wb is None else float(np.min(wb))]))
    print(format_table(["placement", "max/mean min", "median", "max", "/bound median", "/bound max",
                        "balancedness"] + (["per window: median", "worst"] if window_bal else []), rows))
    if window_bal:
        T = trace.num_windows
        how = {"window": f"sum of the newest {args.window} of {T} windows",
               "ema": f"EMA of {T} windows, alpha {0.3 if args.alpha is None else args.alpha:g}",
               "last": f"the last of {T} windows"}.get(args.aggregate, f"{args.aggregate} of {T} windows")
        print(f"max/mean and /bound: per layer on the planning load ({how}); "
              f"per window: balancedness of each window alone")
    print(f"planner {result.planner}: {result.status}, {result.seconds * 1e3:.1f} ms"
          + (f" ({result.message})" if result.message else ""))
    if migration:
        size = "" if migration["bytes"] is None else f", {migration['bytes'] / 2**30:.2f} GiB"
        print(f"moves: {migration['moves']} experts copied onto GPUs that did not hold them{size} "
              f"(most onto one GPU: {migration['moves_max_per_gpu']}; from-scratch plan: "
              f"{migration['moves_from_scratch']}, relabelled: {migration['moves_relabeled']}; "
              f"method: {migration['method']}, {migration['seconds'] * 1e3:.0f} ms)")
        if "group_span_after" in migration:
            print(f"expert groups span {migration['group_span_before']:.2f} -> {migration['group_span_after']:.2f} "
                  f"nodes on average (--span-cost {migration['span_cost']:g})")
    if args.output:
        print(f"wrote {args.output} ({args.format})")
    return 0


def engine_of(args):
    """(rule, engine) from --engine / --dispatch / --format, or (None, None) for eplb's own runtime."""
    from eplb.dispatch import ENGINES, engine_rule
    from eplb.errors import EplbError

    engine = args.engine
    if engine is None and args.format in ENGINES:
        engine = args.format  # an engine's file is served by that engine's rule
    if engine is not None and args.format not in (None, "eplb", engine):
        raise EplbError(f"--engine {engine} does not read --format {args.format} files: use --format {engine} "
                        f"(or --format eplb)")
    if args.dispatch is not None and engine is None:
        raise EplbError(f"--dispatch {args.dispatch} is a mode of an engine: add --engine ({', '.join(ENGINES)})")
    if engine is None:
        return None, None
    return engine_rule(engine, args.dispatch), engine


def ilp_for_engine(args, settings: dict, rule, engine: str) -> None:
    """ilp's default (weighted) plans need dispatch weights that no engine file carries: plan it
    for the engine's even split, or refuse where no ilp model fits the engine's rule."""
    from eplb.errors import EplbError

    if args.planner != "ilp":
        return
    if rule.name != "even":
        raise EplbError(f"--planner ilp models a weighted or an even split; {engine} applies {rule.name} "
                        f"(shares of ranks / GPUs, docs/engines.md): use --planner rule-aware")
    if settings.get("dispatch", "even") != "even":
        raise EplbError(f"--set dispatch={settings['dispatch']} plans dispatch weights, but {engine} splits an "
                        f"expert's tokens evenly and its file carries no weights: drop it (ilp then plans for "
                        f"the even split) or write --format eplb for eplb's runtime")
    if "dispatch" not in settings and not (args.quiet or args.json):
        print(f"ilp plans for {engine}'s even split (--set dispatch=even): its file carries no dispatch weights")
    settings["dispatch"] = "even"


def write_placement(placement, path: str, fmt: str, meta: dict) -> None:
    """Write a placement in one of FORMATS (engine formats live in eplb.formats.export)."""
    if fmt == "eplb":
        placement.save(path)
        return
    from eplb.formats.export import write_placement as write_engine

    write_engine(placement, path, fmt, num_hidden_layers=meta.get("num_hidden_layers"))


