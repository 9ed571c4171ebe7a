"""`eplb synth`: write a seeded synthetic DeepSeek-V3-shaped trace (and compare it to real data)."""

from __future__ import annotations

import argparse
from dataclasses import fields

import numpy as np

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
from eplb.commands.plan import parse_settings
from eplb.core.progress import Progress
from eplb.errors import EplbError
from eplb.formats import load_trace, save_trace
from eplb.stats import calibration, synth


def add_parser(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "synth", "generate a seeded synthetic router trace (DeepSeek-V3 shape)",
                    "eplb synth -o traces/deepseek.npz --windows 32 --seed 0")
    p.add_argument("-o", "--output", required=True, help="output trace file (.npz)")
    p.add_argument("--windows", type=int, default=32, help="time windows (default 32)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per window (default 2048)")
    p.add_argument("--seed", type=seed_int, default=0, help="random seed (default 0)")
    p.add_argument("--skew", type=float, default=None, help="median spread of expert logits (default 0.67)")
    p.add_argument("--id-trend", type=float, default=None,
                   help="median strength of the smooth popularity trend along expert ids (default 0.23)")
    p.add_argument("--phase-share", type=float, default=None,
                   help="logit variance specific to prefill/decode (default 0.18)")
    p.add_argument("--drift-share", type=float, default=None,
                   help="logit variance that drifts per window (default 0.05)")
    p.add_argument("--topic-shifts", type=int, default=None,
                   help="abrupt topic shifts over the trace: at each, a cold expert of some layers turns hot "
                        "(default 0)")
    p.add_argument("--topic-shape", choices=list(synth.SHIFT_SHAPES), default=None,
                   help="shape of the topic shifts (eplb.stats.topic_shifts): abrupt, gradual (a ramp over 4 "
                        "windows), recurring (two topics taking turns), inside (a shift inside a window), local (3 "
                        "experts of 10%% of the layers turning hot); 6 shifts unless --topic-shifts says")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any generator setting of eplb.stats.synth.SynthSettings, e.g. --set num_experts=64 --set "
                        "topic_hot=0.2,0.3 (repeatable; pairs as two comma-separated numbers)")
    shape = p.add_argument_group("model shape (default DeepSeek-V3: 61 hidden layers, MoE from layer 3, 256 experts, "
                                 "top-8, 8 groups, 4 per token)")
    shape.add_argument("--experts", type=positive_int, help="routed experts per MoE layer")
    shape.add_argument("--top-k", type=positive_int, help="experts each token is routed to")
    shape.add_argument("--expert-groups", type=positive_int,
                       help="expert groups of group-limited routing (1 = none, as in Mixtral or OLMoE)")
    shape.add_argument("--topk-groups", type=positive_int,
                       help="groups each token may use (default: 4, or all groups when fewer)")
    shape.add_argument("--hidden-layers", type=positive_int, help="hidden layers of the model (dense and MoE)")
    shape.add_argument("--first-moe-layer", type=int, help="hidden-layer index of the first MoE layer")
    p.add_argument("--keep-tokens", type=int, default=0,
                   help="also store this many tokens' expert choices per window (topk_ids; default 0)")
    p.add_argument("--compare", nargs="*", metavar="TRACE", default=None,
                   help="real traces to compare skew with (e.g. ../shared/traces/deepseek_v3_sglang/*.json)")
    add_output_flags(p)
    return p


def _settings_from_set(items: list[str]) -> dict:
    """--set KEY=VALUE for SynthSettings fields; the pair fields take two comma-separated numbers."""
    names = {f.name: f for f in fields(synth.SynthSettings)}
    out = {}
    for key, value in parse_settings(items).items():
        if key not in names:
            raise EplbError(f"--set {key}: not a generator setting; the settings are {', '.join(names)}")
        if names[key].type.startswith("tuple"):
            try:
                value = tuple(int(x) if names[key].type == "tuple[int, int]" else float(x)
                              for x in str(value).split(","))
            except ValueError:
                raise EplbError(f"--set {key}={value}: expected two comma-separated numbers") from None
        out[key] = value
    return out


def run(args) -> int:
    # Before generating, which takes a minute at full size.
    check_output_path(args.output, "the trace", inputs=[("--compare", t) for t in args.compare or []])
    check_suffix(args.output, (".npz",), "an eplb trace (.npz)")
    # Read before the trace is written: a bad --compare file must fail the run before -o changes.
    reals = {str(p): load_trace(p) for p in args.compare or []}
    shape = {} if args.topic_shape is None else {"topic_shifts": 6, **synth.SHIFT_SHAPES[args.topic_shape]}
    overrides = {**shape, "num_windows": args.windows, "seed": args.seed, "keep_tokens": args.keep_tokens,
                 **_settings_from_set(args.set)}
    topk_groups = args.topk_groups
    if topk_groups is None and args.expert_groups is not None:
        topk_groups = min(4, args.expert_groups)
    for key, value in (("tokens_per_window", args.tokens), ("skew", args.skew), ("id_trend", args.id_trend),
                       ("phase_share", args.phase_share), ("drift_share", args.drift_share),
                       ("topic_shifts", args.topic_shifts), ("num_experts", args.experts), ("top_k", args.top_k),
                       ("num_expert_groups", args.expert_groups), ("topk_groups", topk_groups),
                       ("num_hidden_layers", args.hidden_layers), ("first_moe_layer", args.first_moe_layer)):
        if value is not None:
            overrides[key] = value
    experts = overrides.get("num_experts")
    if experts is not None and "num_expert_groups" not in overrides \
            and experts % synth.SynthSettings.num_expert_groups:
        overrides.update(num_expert_groups=1, topk_groups=1)  # DeepSeek's 8 groups do not divide these experts
    settings = synth.SynthSettings(**overrides)
    with Progress(settings.num_windows, "synth", enabled=None if not args.quiet else False) as bar:
        trace = synth.generate(settings, progress=lambda done, total: bar.update())
    try:
        corr = calibration.phase_correlation(trace)
    except EplbError:  # a short trace may hold one phase only: nothing to correlate
        corr = None
    rows = {"synthetic": {**calibration.calibration_stats(trace.total()), "prefill_decode_corr": corr}}
    if reals:
        for p, t in reals.items():
            rows[p] = {**calibration.calibration_stats(t.total()), "prefill_decode_corr": None}
        pre = [t.total() for p, t in reals.items() if "prefill" in p]
        dec = [t.total() for p, t in reals.items() if "decode" in p]
        # Real files hold one phase each: correlate every prefill file with every decode file.
        corr = [calibration.layer_correlation(a, b) for a in pre for b in dec]
        if corr:
            rows["real prefill x decode"] = {"prefill_decode_corr": float(np.median(corr))}
    save_trace(trace, args.output)  # last: nothing after it can fail the run once -o has changed
    if args.json:
        print_json({"output": args.output, "settings": trace.meta["synth_settings"], "stats": rows})
        return 0
    if not args.quiet:
        print(f"wrote {args.output}: {trace.num_windows} windows x {trace.num_layers} layers x "
              f"{trace.num_logical_experts} experts, phases {''.join(p[0] for p in trace.meta['phases'])} (p/d)")
        if trace.meta.get("topic_shifts"):
            st = synth.topic_shift_stats(trace)
            print(f"{len(set(d['window'] for d in st))} topic shifts, {len(st)} experts turned hot: share of a layer's "
                  f"tokens before {np.median([d['before'] for d in st]):.4f}, after "
                  f"{np.median([d['after'] for d in st]):.3f} (medians)")

        def f(v):
            return "" if v is None else float(v)
        gpus = [g for g in calibration.CONTIGUOUS_GPUS if trace.num_logical_experts % g == 0]
        keys = ("hot_median", "hot_max", "gini_median", *(f"contig_G{g}" for g in gpus), "prefill_decode_corr")
        table = [[name.rsplit("/", 1)[-1][:40], *(f(r.get(k)) for k in keys)] for name, r in rows.items()]
        print(format_table(["trace", "hot/mean med", "hot/mean max", "gini med",
                            *(f"contig {g} GPUs" for g in gpus), "prefill~decode corr"], table))
    return 0
