"""`eplb calibrate`: fit a hardware profile to the runtime shim measured on this machine."""

from __future__ import annotations

import argparse
import time

from eplb.commands.common import (
    add_command,
    add_output_flags,
    check_output_path,
    check_suffix,
    format_table,
    positive_int,
    print_json,
    seed_int,
)
from eplb.core.files import MAX_INPUT_ENV, format_size, max_input_bytes
from eplb.dispatch.calibration import fit_profile
from eplb.errors import EplbError


def _tokens(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"tokens per rank must be >= 1, got {text!r}")
    return values


def add_parser(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "calibrate", "fit a hardware profile (eplb simulate --hardware FILE) to the EP runtime "
                    "shim run on this machine",
                    "eplb calibrate --ranks 4 -o cpu-profile.json")
    p.add_argument("--ranks", type=positive_int, default=4, help="expert-parallel ranks (processes; default 4)")
    p.add_argument("--experts", type=positive_int, default=32, help="logical experts of the shim (default 32)")
    p.add_argument("--layers", type=positive_int, default=2, help="MoE layers (default 2)")
    p.add_argument("--hidden", type=positive_int, default=512, help="D: model dim (default 512)")
    p.add_argument("--expert-hidden", type=positive_int, default=768, help="F: expert hidden dim (default 768)")
    p.add_argument("--top-k", type=positive_int, default=4, help="experts per token (default 4)")
    p.add_argument("--tokens", type=_tokens, default=(1, 2, 4, 8, 16, 32),
                   help="tokens per rank of the batch sizes, comma-separated (default 1,2,4,8,16,32)")
    p.add_argument("--steps", type=positive_int, default=3, help="measured steps per case (default 3)")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="default: nccl with one GPU per rank when there are enough GPUs, else gloo (NCCL is untested)")
    p.add_argument("--output", "-o", help="write the fitted profile here (JSON; give it to --hardware)")
    p.add_argument("--cases", action="store_true", help="also print measured vs predicted per case")
    add_output_flags(p)
    return p


def _check_sizes(args) -> None:
    """Sizes typed on a command line are bounded like inputs (eplb.core.files): the ranks' expert
    weights (fp32 gate, up and down of every slot; ceil(E / G) + 2 slots per rank, as
    eplb.runtime.calibrate.default_cases places them) and one batch's activations."""
    if args.ranks > args.experts:
        raise EplbError(f"--ranks {args.ranks} exceeds the {args.experts} experts: every rank needs an expert")
    slots = args.ranks * min(-(-args.experts // args.ranks) + 2, args.experts)
    need = 4 * (3 * args.hidden * args.expert_hidden * args.layers * slots
                + max(args.tokens) * args.top_k * args.ranks * (args.hidden + args.expert_hidden))
    limit = max_input_bytes()
    if need > limit:
        raise EplbError(f"the shim ({args.layers} layers x {slots} slots of {args.hidden} x {args.expert_hidden} "
                        f"experts, up to {max(args.tokens)} tokens per rank) would take {format_size(need)}, more "
                        f"than the input limit of {format_size(limit)} ({MAX_INPUT_ENV}): smaller --experts, "
                        f"--layers, --hidden, --expert-hidden or --tokens, or raise the limit")


def run(args) -> int:
    if args.output is not None:  # before the measurements, which take minutes
        check_output_path(args.output, "the profile")
        check_suffix(args.output, (".json",), "a hardware profile (JSON)")
    if args.top_k > args.experts:
        raise EplbError(f"--top-k {args.top_k} exceeds the {args.experts} experts")
    _check_sizes(args)
    # eplb.runtime imports torch: only when calibrating, never at the CLI's start-up.
    from eplb.runtime.calibrate import ShimSettings, default_cases, local_world_size, measure

    ranks = local_world_size(args.ranks)
    settings = ShimSettings(hidden=args.hidden, expert_hidden=args.expert_hidden, top_k=args.top_k, steps=args.steps,
                            seed=args.seed)
    cases = default_cases(ranks, args.experts, args.layers, args.tokens, settings)
    t0 = time.perf_counter()
    m = measure(cases, ranks, settings, backend=args.backend)
    hw, rep = fit_profile(m, name=f"calibrated ({m.backend}, {ranks} ranks)")
    rep["seconds"] = time.perf_counter() - t0
    if args.output:
        hw.save(args.output)
    if args.json:
        print_json({"profile": hw.to_dict(), "fit": rep, "output": args.output})
        return 0
    if args.quiet:
        return 0
    print(f"{len(cases)} cases (4 placements x {len(args.tokens)} batch sizes) on {ranks} {m.backend} ranks, "
          f"{args.steps} steps each, in {rep['seconds']:.1f} s")
    print(format_table(["constant", "fitted"], [
        ["overhead per active replica", f"{1e6 * hw.expert_overhead_s:.1f} us"],
        ["FLOP/s (fp32)", f"{hw.flops('fp32') / 1e9:.2f} GFLOP/s"],
        ["memory bandwidth", f"{hw.hbm_bytes_per_s / 1e9:.2f} GB/s"],
        ["all-to-all latency per phase", f"{1e6 * hw.a2a_latency_s:.0f} us"],
        ["link bandwidth", f"{hw.nvlink_bytes_per_s / 1e9:.3f} GB/s"],
    ]))
    print(f"R^2 of per-rank expert time per step: {rep['r2_compute']:.3f} in-sample, "
          f"{rep['r2_compute_held_out']:.3f} on held-out cases (fit on even cases, predict odd); "
          f"all-to-all: {rep['r2_all_to_all']:.3f}")
    if args.cases:
        rows = [[name, max(meas), max(pred)] for name, meas, pred in
                zip(rep["names"], rep["measured_ms_CG"], rep["predicted_ms_CG"])]
        print(format_table(["case", "busiest rank measured ms", "predicted ms"], rows))
    if args.output:
        print(f"wrote {args.output} (use it as --hardware {args.output})")
    return 0
