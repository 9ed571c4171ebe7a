"""`eplb plan`: plan an expert placement from router traces and write it for an engine."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from eplb import stats
from eplb.commands.capacity import add_arguments as add_capacity_arguments
from eplb.commands.capacity import slots_from_args
from eplb.commands.common import (
    REDUNDANT_HELP,
    add_command,
    add_output_flags,
    check_output_path,
    check_suffix,
    format_table,
    layer_id_list,
    positive_int,
    print_json,
)
from eplb.commands.simulate import add_cost_arguments, batch_from_args, cost_from_args, modeled_table
from eplb.core.placement import contiguous_placement
from eplb.core.progress import Notice
from eplb.core.trace import Trace
from eplb.dispatch.cost import TimeObjective
from eplb.dispatch.resplit_score import resplit_imbalance
from eplb.dispatch.rules import ENGINES, DispatchRule, Resplit, engine_rule
from eplb.dispatch.sglang_lp import SglangLp
from eplb.errors import EplbError
from eplb.evaluate.simulate import simulate
from eplb.formats import load_history, load_placement
from eplb.formats.export import EXTENSIONS, FORMATS, formats_for_name, write_placement
from eplb.migration import Budget
from eplb.planning import front_door as planning
from eplb.planning.front_door import plan_for_resplit, resplit_windows
from eplb.planning.resplit_plan import re_splits, window_scores
from eplb.stats.loads import AGGREGATIONS, Aggregation, window_balancedness
from planners.api import planner_names, planner_settings, setting_value

MIGRATION_FLAGS = ("max_moves", "max_moves_per_gpu", "move_cost", "span_cost", "bytes_per_expert")
"""Options that become the plan's eplb.Budget (they act only with --previous)."""


def add_parser(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "plan", "plan an expert-to-GPU placement from router traces",
                    "eplb plan traces/deepseek.npz --gpus 16 -o plan.json")
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help="trace files (eplb .npz, .npy, SGLang JSON/.pt); several = history, oldest first")
    p.add_argument("--gpus", "-g", type=positive_int, required=True, help="expert-parallel GPUs (ranks)")
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes the GPUs are spread over (default 1)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--redundant", type=int, help=REDUNDANT_HELP)
    size.add_argument("--slots-per-gpu", help="physical slots per GPU (instead of --redundant), or 'auto': "
                                               "as many as fit in memory next to the KV cache (capacity options)")
    # robust is the CLI default: it wins on held-out traffic (docs/backtests.md); the
    # API's eplb.plan() keeps greedy as its default because serving loops call it per rebalance.
    # Under an engine rule whose shares depend on the layout (SGLang's), rule-aware is the default.
    p.add_argument("--planner", "-p", default=None, choices=planner_names(),
                   help="algorithm (default robust: plans against every window of the history; "
                        "rule-aware with --engine sglang, except under --dispatch lp)")
    p.add_argument("--engine", "-e", choices=list(ENGINES),
                   help="engine that serves the plan: the report scores it under that engine's dispatch rule "
                        "(docs/engines.md); default the engine of --format")
    p.add_argument("--dispatch", metavar="MODE",
                   help="the engine's dispatch mode (sglang: static (default), dynamic or lp; vllm, trtllm: even); "
                        "without --engine: resplit, eplb's runtime re-splitting each batch. Under lp or resplit the "
                        "plan is searched for the per-batch re-split (docs/dispatch.md)")
    p.add_argument("--aggregate", default="sum", choices=AGGREGATIONS,
                   help="how windows become the planning load (default sum)")
    p.add_argument("--window", type=positive_int, help="with --aggregate window: newest windows to sum")
    p.add_argument("--alpha", type=float, help="with --aggregate ema: weight of the newest window (default 0.3)")
    p.add_argument("--expert-groups", "--groups", type=positive_int,
                   help="expert groups of the router (default: from the trace)")
    p.add_argument("--output", "-o", help="write the placement here")
    p.add_argument("--format", "-f", choices=FORMATS,
                   help="file format of --output: eplb JSON, SGLang --init-expert-location JSON, "
                        "vLLM .pt tensors, TensorRT-LLM load_balancer YAML (default eplb)")
    p.add_argument("--layer-ids", type=layer_id_list, metavar="IDS",
                   help="hidden-layer index of each MoE layer of the trace, e.g. 3-60 or 1,3,5 (a .npy trace "
                        "records none, so 0..L-1 is assumed; give them for a model with dense layers)")
    p.add_argument("--num-hidden-layers", type=positive_int, metavar="H",
                   help="with --format sglang: rows of the map, the model's hidden layers (default: the "
                        "trace's, or the largest MoE layer id + 1)")
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
    add_capacity_arguments(p, for_plan=True)
    p.add_argument("--objective", choices=("tokens", "time"), default="tokens",
                   help="balance token loads (default), or modeled per-GPU time (needs --model and --hardware; "
                        "serve it with the per-batch time dispatch)")
    add_cost_arguments(p, model_flag=False)
    add_output_flags(p)
    return p


def parse_settings(items: list[str]) -> dict:
    """KEY=VALUE strings into a dict; values parsed as int, float, bool or kept as text."""
    out: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise EplbError(f"--set expects KEY=VALUE, got {item!r}")
        out[key.strip()] = setting_value(text)
    return out


def _check_flags(args) -> None:
    """Options that only act together with another one are refused alone, not ignored."""
    if args.format is not None and args.output is None:
        raise EplbError(f"--format {args.format} sets the file format of --output: add -o FILE")
    # --engine names the file format of -o when --format does not (engine_of applies it later).
    fmt = args.format or (args.engine if args.engine and args.output else "eplb")
    if args.num_hidden_layers is not None and fmt != "sglang":
        raise EplbError(f"--num-hidden-layers {args.num_hidden_layers} sets the rows of an SGLang map: add "
                        f"--format sglang -o FILE, or drop it")
    if args.output is not None:
        others = formats_for_name(args.output, fmt)
        if others:  # JSON named plan.yaml, or a vLLM zip named x.json
            default = "" if args.format else " (the default)"
            raise EplbError(f"-o {args.output} ends in a name for {' or '.join(others)} files, but --format is "
                            f"{fmt}{default}: add --format {others[0]}, or name the file "
                            f"{' or '.join('*' + e for e in EXTENSIONS[fmt])}")
    if args.slots_per_gpu != "auto":
        # --model and --expert-dtype also describe the experts to the cost model (with --hardware).
        sizing = ("gpu_memory", "context", "concurrency") + (() if args.hardware else ("model", "expert_dtype"))
        given = [f"--{k.replace('_', '-')}" for k in sizing if getattr(args, k) is not None]
        if given:
            raise EplbError(f"{', '.join(given)} size the slots only with --slots-per-gpu auto: add it, or drop them")
    if args.output is not None:  # before planning, which may take minutes
        inputs = [("TRACE", t) for t in args.traces] + [("--previous", args.previous), ("--hardware", args.hardware)]
        check_output_path(args.output, "the placement", inputs=inputs)
        check_suffix(args.output, EXTENSIONS[fmt], f"a {fmt} placement")


def engine_of(args) -> tuple[DispatchRule | None, str | None]:
    """(rule, engine) from --engine / --dispatch / --format, or (None, None) for eplb's own runtime."""
    engine = args.engine
    if engine is None and args.format in ENGINES:
        engine = args.format  # an engine's file is served by that engine's rule
    if engine is not None and args.format not in (None, "eplb", engine):
        raise EplbError(f"--engine {engine} does not read --format {args.format} files: use --format {engine} "
                        f"(or --format eplb)")
    if args.dispatch is not None and engine is None:
        if args.dispatch == "resplit":  # eplb's own runtime, re-splitting every batch
            return Resplit(), None
        raise EplbError(f"--dispatch {args.dispatch} is a mode of an engine: add --engine ({', '.join(ENGINES)}); "
                        f"without --engine only --dispatch resplit (eplb's runtime re-splitting each batch)")
    if engine is None:
        return None, None
    return engine_rule(engine, args.dispatch), engine


def ilp_for_engine(args, settings: dict, rule: DispatchRule, engine: str) -> None:
    """ilp's default (weighted) plans need dispatch weights that no engine file carries: plan it
    for the engine's even split, or refuse where no ilp model fits the engine's rule."""
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


def _budget(args, trace) -> Budget | None:
    """The migration flags as a Budget (None when none is given and there is no --previous)."""
    if args.previous and args.span_cost is not None and (
            args.nodes == 1 or not (args.expert_groups or trace.meta.get("num_expert_groups"))):
        raise EplbError(f"--span-cost {args.span_cost:g} prices spreading an expert group onto one more node, so "
                        f"it needs --nodes > 1 and expert groups (--expert-groups, or the trace's "
                        f"num_expert_groups); give both or drop --span-cost")
    given = {k: getattr(args, k) for k in MIGRATION_FLAGS
             if getattr(args, k) is not None and not (k == "move_cost" and getattr(args, k) == 0.0)}
    if given and not args.previous:  # named as typed (a Budget's defaults would hide --span-cost 1)
        flags = ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in given.items())
        raise EplbError(f"{flags}: migration options need the placement now served (--previous OLD.json); "
                        f"drop them for a plan from scratch")
    return Budget(**given) if given or args.previous else None


def _slots(args, trace, previous):
    """(slots per GPU or None, the capacity report behind --slots-per-gpu auto or None)."""
    if args.slots_per_gpu == "auto":
        capacity = slots_from_args(args, trace.num_logical_experts)
        return capacity.slots_per_gpu, capacity
    if args.slots_per_gpu is not None:
        try:
            return int(args.slots_per_gpu), None
        except ValueError:
            raise EplbError(f"--slots-per-gpu must be a whole number, got {args.slots_per_gpu!r}") from None
    if previous is not None and args.redundant is None:
        return previous.slots_per_gpu, None  # same slots as the placement being replaced
    return None, None


def objective_from_args(args) -> str | TimeObjective:
    """"tokens", or the TimeObjective the cost options describe (refusing options that need others)."""
    cost_opts = [f"--{k.replace('_', '-')}" for k in ("phase", "batch_tokens") if getattr(args, k) is not None]
    cost_opts += ["--overlap"] if args.overlap else []
    if args.hardware is None:
        if args.objective == "time":
            raise EplbError("--objective time balances modeled time: give --model M and --hardware H "
                            "(e.g. --model deepseek-v3 --hardware h200)")
        if cost_opts:
            raise EplbError(f"{', '.join(cost_opts)} describe the cost model: add --hardware (and --model)")
        return "tokens"
    if args.model is None:
        raise EplbError("--hardware needs --model: the experts' shape (e.g. --model deepseek-v3)")
    if args.objective == "tokens":
        return "tokens"
    return TimeObjective(cost_from_args(args), batch_tokens=args.batch_tokens, phase=args.phase or "decode")


def _modeled(args, placement, trace, objective, engine_rule_: DispatchRule | None) -> dict:
    """Modeled step time of the plan and the contiguous placement on the planning trace, under
    the engine's rule when one serves it (else the time dispatch for a time plan, or even)."""
    cost = objective.cost if objective != "tokens" else cost_from_args(args)
    B, phase = batch_from_args(args, placement.num_gpus)
    if engine_rule_ is not None:
        rule = engine_rule_.name
    else:
        rule = "time" if objective != "tokens" else "even"
    rep = simulate(cost, placement, trace, rule=rule, batch_tokens=B,
                   batches_per_window=max(1, 64 // trace.num_windows), seed=0)
    out = rep.summary()
    out.update({"model": cost.model.name, "hardware": cost.hardware.name, "phase": phase})
    return out


def _layers(args, trace: Trace) -> tuple[Trace, int | None, list[str]]:
    """(the trace with --layer-ids applied, the SGLang row count, notes on what was assumed)."""
    notes = []
    if args.layer_ids is not None:
        if len(args.layer_ids) != trace.num_layers:  # counted before they are listed: 0-10000000000 is 10**10
            raise EplbError(f"--layer-ids {args.layer_ids.text} gives {len(args.layer_ids):,} layer ids, but the trace "
                            f"has {trace.num_layers} MoE layers: give one id per MoE layer")
        ids = args.layer_ids.array()
        if not trace.meta.get("layer_ids_assumed") and not np.array_equal(ids, trace.layer_ids):
            raise EplbError(f"--layer-ids disagrees with the layer ids {args.traces[0]} records "
                            f"({trace.layer_ids[0]}..{trace.layer_ids[-1]}): drop --layer-ids")
        meta = {k: v for k, v in trace.meta.items() if k != "layer_ids_assumed"}
        if meta["num_hidden_layers"] is not None and meta["num_hidden_layers"] <= ids.max():
            raise EplbError(f"--layer-ids reach {ids.max()}, but the trace records num_hidden_layers = "
                            f"{meta['num_hidden_layers']}")
        trace = Trace(trace.counts_TLE, ids, meta)
    hidden = trace.meta.get("num_hidden_layers")
    if args.num_hidden_layers is not None:
        if hidden is not None and hidden != args.num_hidden_layers:
            raise EplbError(f"--num-hidden-layers {args.num_hidden_layers}, but the trace records num_hidden_layers "
                            f"= {hidden}: drop --num-hidden-layers")
        if args.num_hidden_layers <= trace.layer_ids.max():
            raise EplbError(f"--num-hidden-layers {args.num_hidden_layers} must exceed the largest MoE layer id "
                            f"({trace.layer_ids.max()}); the SGLang map has a row per hidden layer")
        hidden = args.num_hidden_layers
    if args.output and trace.meta.get("layer_ids_assumed"):
        L = trace.num_layers
        rows = f", and the SGLang map gets {hidden or L} rows" if args.format == "sglang" else ""
        notes.append(f"{args.traces[0]} records no layer ids: its {L} MoE layers were taken as hidden layers "
                     f"0..{L - 1}{rows}; for a model with dense layers give --layer-ids (e.g. 3-60)"
                     + (" and --num-hidden-layers" if args.format == "sglang" else ""))
    return trace, hidden, notes


def _check_previous(args, previous) -> None:
    """A migration keeps the GPUs it starts from: a plan for other GPUs is refused by name."""
    if previous is not None and previous.num_gpus != args.gpus and args.redundant is None \
            and args.slots_per_gpu is None:
        raise EplbError(f"--previous {args.previous} is served on {previous.num_gpus} GPUs ({previous.slots_per_gpu} "
                        f"slots each) but --gpus is {args.gpus}: a plan that migrates from it keeps its GPUs; give "
                        f"--gpus {previous.num_gpus}, or drop --previous to plan {args.gpus} GPUs from scratch")


def run(args) -> int:
    _check_flags(args)
    objective = objective_from_args(args)
    rule, engine = engine_of(args)
    args.format = args.format or (engine if engine and args.output else "eplb")
    if args.planner is None:
        args.planner = "rule-aware" if rule is not None and planning.layout_dependent(rule) else "robust"
    trace, hidden, notes = _layers(args, load_history(args.traces))
    if isinstance(rule, SglangLp) and rule.path == "startup" and args.output:
        notes.append("SGLang serves an --init-expert-location map under lp with each rank's lists cut to its nearest "
                     "replica (same GPU, else same node), so most ranks skip the LP (the 'served by' rows); a map its "
                     "rebalance installs (python -m eplb.integrations.sglang, --enable-eplb) is split by the LP on "
                     "every rank")
    if args.window is not None and args.window > trace.num_windows:
        raise EplbError(f"--window {args.window} asks for more windows than the trace holds ({trace.num_windows}): "
                        f"use --window {trace.num_windows} or less (or --aggregate sum for all of them)")
    settings = parse_settings(args.set)
    if (args.quiet or args.json) and "quiet" in planner_settings(args.planner):
        settings.setdefault("quiet", True)  # no progress bar when asked for silence
    if engine is not None:
        ilp_for_engine(args, settings, rule, engine)
    budget = _budget(args, trace)
    previous = load_placement(args.previous) if args.previous else None
    _check_previous(args, previous)
    slots, capacity = _slots(args, trace, previous)
    aggregation = Aggregation(args.aggregate, args.window, args.alpha)
    what = f"eplb plan: {args.planner} on {trace.num_layers} layers x {trace.num_logical_experts} experts"
    # Planners with a progress bar of their own (a "quiet" setting: ilp) draw it themselves.
    own_bar = "quiet" in planner_settings(args.planner)
    with Notice(f"{what}, {trace.num_windows} window(s) ...",
                enabled=False if args.quiet or args.json or own_bar else None):
        result = planning.plan(
            trace, num_gpus=args.gpus, num_nodes=args.nodes, num_redundant=args.redundant, slots_per_gpu=slots,
            planner=args.planner, aggregate=aggregation,
            num_expert_groups=args.expert_groups, settings=settings, previous=previous, budget=budget,
            objective=objective, dispatch=rule, resplit_rounds=0,
        )
        resplit = None
        if re_splits(rule):  # the search as eplb.plan runs it, on the planner's plan kept for the report
            windows = resplit_windows(trace.counts_TLE, aggregation)
            even_plan = result
            result = plan_for_resplit(result, windows, previous, budget)
            resplit = _resplit_scores(result, even_plan, previous, windows)
    if not result.load_LE.any():  # any placement "balances" nothing: do not write one as if it did
        which = "the trace" if args.aggregate == "sum" else f"the planning load (--aggregate {args.aggregate})"
        raise EplbError(f"{which} holds no tokens (every count is zero): there is no load to balance; "
                        f"check the collector, or plan on windows with traffic")
    window_bal = None
    if trace.num_windows > 1:
        # Each window alone (robust plans for these; the summed-load columns hide them).
        pl = result.placement
        scored = [("contiguous", contiguous_placement(pl.num_logical_experts, pl.topology, pl.layer_ids))]
        scored += [("previous", previous)] if previous is not None else []
        window_bal = {name: window_balancedness(p, trace.counts_TLE) for name, p in scored + [("plan", pl)]}
    modeled = _modeled(args, result.placement, trace, objective, rule) if args.hardware else None
    if args.output:  # after everything that can fail: a failed run leaves -o as it was
        write_placement(result.placement, args.output, args.format, num_hidden_layers=hidden)
    if not args.quiet and not args.json:
        for note in notes:
            print(f"eplb plan: note: {note}", file=sys.stderr)
    if args.json:
        migration = result.info.get("migration")
        out = result.summary()
        out["modeled"] = modeled
        out["window_balancedness"] = None if window_bal is None else {k: v.tolist() for k, v in window_bal.items()}
        out["output"] = args.output
        out["format"] = args.format
        out["capacity"] = capacity.to_dict() if capacity else None
        out["moves"] = migration["moves"] if migration else None
        out["bytes_moved"] = migration["bytes"] if migration else None
        out["notes"] = notes
        out["resplit"] = resplit
        print_json(out)
    elif not args.quiet:
        _print_report(args, trace, result, previous, capacity, window_bal, modeled, engine)
        if resplit:
            _print_resplit(resplit)
    return 0


def _resplit_scores(result, even_plan, previous, windows) -> dict:
    """Exact re-split score (busiest / mean GPU under the best split, per window and layer) of the
    plan, of the planner's even-split plan it was searched from, and of --previous; under SGLang's
    lp also the score that rule serves (`window_scores`)."""
    G, rule = result.topology.num_gpus, result.dispatch
    scored = [("plan", result.solution.phy2log_LP), ("even-split plan", even_plan.solution.phy2log_LP)]
    scored += [("previous", previous.phy2log_LP)] if previous is not None else []
    out = {"windows": int(len(windows)), "dispatch": rule.name}

    def summary(imb):
        return {"median": float(np.median(imb)), "p95": float(np.percentile(imb, 95)), "max": float(imb.max())}

    for name, phy in scored:
        out[name] = summary(resplit_imbalance(phy, windows, G))
    if isinstance(rule, SglangLp):
        for name, phy in scored:
            out[f"{name}, served by {rule.name} ({rule.path})"] = summary(
                window_scores(rule, phy, windows, result.topology, result.layer_ids))
    return out


def _print_resplit(resplit: dict) -> None:
    rows = [[name, v["median"], v["p95"], v["max"]] for name, v in resplit.items() if isinstance(v, dict)]
    print(f"re-split score: busiest / mean GPU of each of the {resplit['windows']} window(s) x layer under the best "
          f"per-batch split (exact), or as {resplit['dispatch']} serves it:")
    print(format_table(["placement", "median", "p95", "max"], rows))


def _print_report(args, trace, result, previous, capacity, window_bal, modeled, engine) -> None:
    pl = result.placement
    redundant = pl.num_slots - pl.num_logical_experts
    why = ""
    if args.redundant is None and args.slots_per_gpu is None and previous is None and redundant > pl.num_gpus:
        # The default sizing rounds E up to a multiple of G before adding one slot per GPU: say so.
        why = (f": one per GPU plus {redundant - pl.num_gpus} that round {pl.num_logical_experts} experts up to a "
               f"multiple of {pl.num_gpus} GPUs")
    print(f"{trace.num_layers} MoE layers x {trace.num_logical_experts} experts, {trace.num_windows} window(s); "
          f"{pl.num_gpus} GPUs on {pl.num_nodes} node(s), {pl.num_slots} slots "
          f"({redundant} redundant{why}; {pl.slots_per_gpu} per GPU)")
    if capacity:
        print(f"slots per GPU auto: {capacity.slots_per_gpu} fit on {capacity.deployment.gpu_memory / 2**30:.1f} GiB "
              f"next to {capacity.concurrency:,} sequences x {capacity.deployment.context:,} tokens "
              f"({capacity.free_bytes_per_gpu / 2**30:.2f} GiB left per GPU; see `eplb capacity`)")
    rows = []
    reports = [("contiguous (no EPLB)", result.before)]
    if previous is not None:  # scored like the plan: under the rule that serves it
        load_LE = result.load_LE
        reports.append((f"previous ({args.previous})",
                        stats.evaluate(previous, load_LE, result.dispatch.bind(previous)(load_LE))))
    if result.served is None:
        reports.append((f"{result.planner}", result.after))
    else:
        own = " (plan's weights)" if pl.dispatch_weights_LP is not None else " (even split)"
        reports.append((f"{result.planner}{own}", result.planned))
    # Per window (window_bal: contiguous, previous, plan) under each placement's own weights.
    per_window = list(window_bal.values()) if window_bal else [None] * len(reports)
    if result.served is not None:
        by = engine or "eplb's runtime"
        reports.append((f"{result.planner}, served by {by} ({result.dispatch.name})", result.served))
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
    migration = result.info.get("migration")
    if migration:
        size = "" if migration["bytes"] is None else f", {migration['bytes'] / 2**30:.2f} GiB"
        print(f"moves: {migration['moves']} experts copied onto GPUs that did not hold them{size} "
              f"(most onto one GPU: {migration['moves_max_per_gpu']}; from-scratch plan: "
              f"{migration['moves_from_scratch']}, relabelled: {migration['moves_relabeled']}; "
              f"method: {migration['method']}, {migration['seconds'] * 1e3:.0f} ms)")
        if "group_span_after" in migration:
            print(f"expert groups span {migration['group_span_before']:.2f} -> {migration['group_span_after']:.2f} "
                  f"nodes on average (--span-cost {migration['span_cost']:g})")
    if modeled:
        print(f"modeled ({modeled['model']} on {modeled['hardware']}, {modeled['phase']}, dispatch "
              f"{modeled['dispatch']}; {modeled['batches']}; on the planning trace):")
        print(modeled_table(modeled))
    if args.output:
        print(f"wrote {args.output} ({args.format})")
