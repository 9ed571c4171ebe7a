"""`eplb simulate`: modeled MoE step time of a plan on a trace (hardware cost model)."""

from __future__ import annotations

import argparse

import numpy as np

from eplb.commands.common import add_command, add_output_flags, format_table, positive_int, print_json, seed_int
from eplb.core.hardware import PROFILES
from eplb.dispatch.cost import PHASE_TOKENS_PER_GPU, PHASES, cost_model, default_batch_tokens
from eplb.errors import EplbError
from eplb.evaluate.simulate import DISPATCH_CHOICES, simulate
from eplb.formats import load_history, load_placement
from eplb.stats.capacity import DTYPE_BITS, PRESETS


def add_cost_arguments(p, *, model_flag: bool = True) -> None:
    """Cost-model options shared by `simulate` and `plan` (plan's capacity options already have
    --model and --expert-dtype, which it shares)."""
    g = p.add_argument_group("cost model (docs/cost-model.md)")
    if model_flag:
        g.add_argument("--model", "-m", required=True, help=f"model preset: {', '.join(PRESETS)}")
    g.add_argument("--hardware", help=f"GPU profile: {', '.join(PROFILES)}, or a JSON/YAML profile file")
    g.add_argument("--phase", choices=PHASES, default=None,
                   help="decode (memory-bound, default) or prefill (compute-bound); sets the default batch: "
                        + ", ".join(f"{k} {v} tokens per GPU" for k, v in PHASE_TOKENS_PER_GPU.items()))
    g.add_argument("--batch-tokens", type=positive_int, metavar="B",
                   help="tokens per step over all GPUs (default: the phase's tokens per GPU x GPUs)")
    if model_flag:
        g.add_argument("--expert-dtype", default=None, choices=list(DTYPE_BITS),
                       help="dtype of the experts' weights and GEMMs (default fp8)")
    g.add_argument("--overlap", action="store_true",
                   help="communication hidden under computation (two-micro-batch overlap)")


def add_time_scoring_arguments(p, objective_help: str) -> None:
    """--objective, the cost model and --batches, as `backtest` and `replay` take them (every
    window is scored in modeled step time too when the cost model is given)."""
    p.add_argument("--objective", choices=("tokens", "time"), default="tokens", help=objective_help)
    p.add_argument("--model", "-m", help=f"model preset for the cost model: {', '.join(PRESETS)}")
    p.add_argument("--expert-dtype", default=None, choices=list(DTYPE_BITS),
                   help="dtype of the experts' weights and GEMMs (default fp8)")
    add_cost_arguments(p, model_flag=False)
    p.add_argument("--batches", type=positive_int, default=8,
                   help="step batches per window scored in modeled time (default 8)")


def cost_from_args(args):
    """The CostModel the options describe."""
    return cost_model(args.model, args.hardware, expert_dtype=args.expert_dtype or "fp8", overlap=bool(args.overlap))


def batch_from_args(args, num_gpus: int) -> tuple[int, str]:
    """(tokens per step, phase) from --batch-tokens / --phase."""
    phase = args.phase or "decode"
    return (args.batch_tokens or default_batch_tokens(phase, num_gpus)), phase


def add_parser(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "simulate", "modeled MoE step time of a plan on a trace (roofline + all-to-all model)",
                    "eplb simulate traces/deepseek.npz --plan plan.json --model deepseek-v3 --hardware h200 "
                    "--batch-tokens 32")
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace files; every window is scored")
    p.add_argument("--plan", required=True, metavar="PLAN.json", help="placement (eplb JSON, from `eplb plan`)")
    add_cost_arguments(p)
    p.add_argument("--whole-windows", action="store_true",
                   help="score each window as one batch as it is (instead of batches of --batch-tokens)")
    p.add_argument("--batches", type=positive_int, default=8, help="batches per window (default 8)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the drawn batches (count traces)")
    p.add_argument("--dispatch", choices=DISPATCH_CHOICES, default=None,
                   help="how replicas share an expert's rows (default: time for plans made with "
                        "--objective time, else even)")
    p.add_argument("--per-layer", action="store_true", help="also print the per-layer table")
    add_output_flags(p)
    return p


def run(args) -> int:
    if args.hardware is None:
        raise EplbError("--hardware is needed: a GPU profile (h100, h200, b200, cpu) or a JSON/YAML profile file")
    if args.whole_windows and args.batch_tokens is not None:
        raise EplbError(f"--whole-windows scores each window as it is; --batch-tokens {args.batch_tokens} cuts "
                        f"windows into batches: give one of the two")
    cost = cost_from_args(args)
    placement = load_placement(args.plan)
    trace = load_history(args.traces)
    B, phase = (None, args.phase or "decode") if args.whole_windows else batch_from_args(args, placement.num_gpus)
    rule = args.dispatch or ("time" if placement.metrics.get("objective") == "time" else "even")
    rep = simulate(cost, placement, trace, rule=rule, batch_tokens=B, batches_per_window=args.batches,
                   seed=args.seed)
    out = rep.summary()
    out.update({"plan": args.plan, "model": cost.model.name, "hardware": cost.hardware.name, "phase": phase,
                "overlap": cost.overlap, "expert_dtype": cost.expert_dtype, "num_gpus": placement.num_gpus,
                "num_nodes": placement.num_nodes})
    if args.json:
        print_json(out)
        return 0
    if not args.quiet:
        print(report_text(cost, placement, rep, out, phase, args.plan, per_layer=args.per_layer))
    return 0


def modeled_table(out: dict, names: tuple[str, ...] = ("contiguous", "plan", "perfect balance")) -> str:
    """The side-by-side table of contiguous, plan and perfect balance (medians over windows)."""
    w = out["windows"]
    ms = lambda key: 1e3 * w[key]["median"]  # noqa: E731
    p95 = lambda key: 1e3 * w[key]["p95"]  # noqa: E731
    a2a, a2a_c = out["all_to_all_bytes_per_token"], out["contiguous_all_to_all_bytes_per_token"]
    rows = [
        [names[0], ms("contiguous_moe_step_seconds"), p95("contiguous_moe_step_seconds"),
         ms("contiguous_busiest_gpu_expert_seconds"), out["contiguous_straggler_time"], "",
         a2a_c["intra_node"] / 1e3, a2a_c["inter_node"] / 1e3, out["contiguous_moe_tokens_per_second"]],
        [names[1], ms("moe_step_seconds"), p95("moe_step_seconds"), ms("busiest_gpu_expert_seconds"),
         out["straggler_time"], out["straggler_tokens"], a2a["intra_node"] / 1e3, a2a["inter_node"] / 1e3,
         out["plan_moe_tokens_per_second"]],
        [names[2], ms("ideal_moe_step_seconds"), p95("ideal_moe_step_seconds"), "", 1.0, "", "", "",
         out["ideal_moe_tokens_per_second"]],
    ]
    return format_table(["placement", "MoE step ms", "p95 ms", "busiest-GPU experts ms", "straggler time",
                         "straggler tokens", "NVLink KB/token", "inter-node KB/token", "MoE tokens/s"], rows)


def report_text(cost, placement, rep, out: dict, phase: str, plan_name: str, *, per_layer: bool) -> str:
    lines = [cost.describe(),
             f"plan {plan_name}: {placement.planner or 'unnamed planner'}, {placement.num_gpus} GPUs on "
             f"{placement.num_nodes} node(s), {placement.num_slots} slots; dispatch rule: {rep.rule}",
             f"batches: {rep.how}; {out['num_batches']} batches over {out['num_windows']} window(s); "
             f"figures are medians over windows (p95 beside)",
             modeled_table(out)]
    step, base, ideal = (out["moe_step_seconds"], out["contiguous_moe_step_seconds"], out["ideal_moe_step_seconds"])
    B = out["batch_tokens"]
    what = "MoE part of TPOT" if phase == "decode" else "MoE time per step"
    lines.append(f"{phase} at {B:,.0f} tokens per step: {what} {1e3 * step:.3f} ms (contiguous {1e3 * base:.3f} ms, "
                 f"perfect balance {1e3 * ideal:.3f} ms): {base / step:.2f}x the contiguous placement's MoE "
                 f"throughput, {ideal / step:.0%} of the physical limit (attention, dense layers and shared "
                 f"experts are not modeled)")
    pl = out["per_layer"]
    plan_L, ideal_L = np.array(pl["moe_seconds"]), np.array(pl["ideal_moe_seconds"])
    worst = int(np.argmax(plan_L / np.maximum(ideal_L, 1e-30)))
    lines.append(f"per layer (mean over batches): plan {1e3 * np.median(plan_L):.3f} ms in the median layer; "
                 f"furthest from perfect balance: layer {pl['layer_ids'][worst]} ({1e3 * plan_L[worst]:.3f} ms, "
                 f"limit {1e3 * ideal_L[worst]:.3f} ms)" + ("" if per_layer else "; --per-layer for all"))
    if per_layer:
        rows = [[int(i), 1e3 * a, 1e3 * b, 1e3 * c] for i, a, b, c in
                zip(pl["layer_ids"], pl["moe_seconds"], pl["contiguous_moe_seconds"], pl["ideal_moe_seconds"])]
        lines.append(format_table(["layer", "plan ms", "contiguous ms", "perfect balance ms"], rows))
    return "\n".join(lines)
