"""Expert-parallel MoE layers before and after load balancing, on trace-driven traffic.

    torchrun --standalone --nproc-per-node 4 examples/ep_moe_demo.py --trace traces/deepseek.npz \
        --planner greedy --json report.json

Each rank (attention is data-parallel) brings its own tokens to a stack of MoE layers of the
reference model (`eplb.runtime.model.MoE`, small sizes, all 256 experts of the trace). The
routers are driven by one trace window's per-layer expert frequencies (`Router.drive`), so
the real skew of the trace reaches the runtime. The stack runs twice on the same tokens:
1. with the contiguous placement (expert e on rank e // (E / G): no load balancing);
2. with the plan `eplb.plan(..., planner=--planner)` made from the trace's other windows
   (plan on history, serve the held-out window), after moving the weights there in place
   with point-to-point transfers (`eplb.runtime.apply`).
It reports, per phase, the token and compute-time straggler ratios (busiest rank / mean
rank), all-to-all time and step latency, the largest difference from the single-device
reference, and KV-cache bytes per token (MLA vs MHA/GQA). gloo on CPU, NCCL on GPUs (device
from LOCAL_RANK). With no trace file it generates the synthetic one and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from eplb import plan
from eplb.commands.common import positive_int
from eplb.core.outputs import write_text
from eplb.core.placement import Placement, contiguous_map
from eplb.core.topology import Topology
from eplb.core.trace import Trace
from eplb.errors import EplbError
from eplb.formats import load_trace
from eplb.runtime.apply import apply_placement, plan_migration
from eplb.runtime.ep import MODES, ExpertParallelMoE
from eplb.runtime.measure import Recorder
from eplb.runtime.model import ModelConfig, MoE


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", default="traces/deepseek.npz", help="trace file (eplb .npz or SGLang JSON)")
    p.add_argument("--planner", default="greedy", help="planner name (eplb.planner_names())")
    p.add_argument("--json", default=None, help="write the report here (rank 0)")
    p.add_argument("--layers", type=positive_int, default=4, help="MoE layers to run, spread evenly over the trace's")
    p.add_argument("--window", type=int, default=-1, help="trace window that drives the routers (default: last)")
    p.add_argument("--tokens", type=positive_int, default=1024,
                   help="tokens per rank per step (enough rows that compute time follows rows, not per-slot overhead)")
    p.add_argument("--steps", type=positive_int, default=8, help="measured steps per phase")
    p.add_argument("--hidden", type=positive_int, default=64, help="D: model dim")
    p.add_argument("--expert-hidden", type=positive_int, default=64, help="F: expert intermediate size")
    p.add_argument("--mode", default="even", choices=MODES, help="replica choice of the planned phase")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load(path: str, rank: int) -> Trace:
    if Path(path).exists():
        return load_trace(path)
    from eplb.stats.synth import generate

    if rank == 0:
        print(f"trace {path!r} not found: using the synthetic DeepSeek-V3-shaped trace of eplb.stats.synth (seed 0)",
              flush=True)
    return generate()


def run_phase(moes, eps, recorder, args, rank, device, freq_LE):
    """Run the stack for --steps steps (after one warm-up step); returns max |EP - reference|."""
    gens = []
    for l, m in enumerate(moes):
        g = torch.Generator(device=device).manual_seed(args.seed * 100_003 + 1009 * rank + l)
        m.gate.drive(freq_LE[l], g)
        gens.append(g)
    xgen = torch.Generator(device=device).manual_seed(args.seed * 7919 + rank)
    err = 0.0
    for step in range(args.steps + 1):
        x = torch.randn(args.tokens, args.hidden, generator=xgen, device=device)
        inputs = []
        measured = step > 0  # step 0 warms up (allocations, first-use costs)
        with recorder.step(device) if measured else _null():
            for l, (m, ep) in enumerate(zip(moes, eps)):
                # Pre-norm residual block, as in DeepSeek's (without attention, which is
                # data-parallel and the same in both phases).
                h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
                ids, w = m.gate(h)
                y = ep(h, ids, w)
                inputs.append((h, ids, w, y))
                if measured:
                    recorder.record(l, ep.last)
                x = x + y
        # The single-device reference on the very same inputs, outside the timed step.
        for l, (xi, ids, w, y) in enumerate(inputs):
            err = max(err, float((y - moes[l].routed(xi, ids, w)).abs().max()))
    return err


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    args = parse(argv)
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # One thread per rank: ranks share the cores, and thread CPU time is then the whole
        # expert computation (measure.py).
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    group = dist.group.WORLD
    rank, G = dist.get_rank(group), dist.get_world_size(group)
    try:
        report = run(args, rank, G, group, device)
    except EplbError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    report["seconds_total"] = round(time.perf_counter() - t_start, 2)
    if rank == 0:
        show(report)
        if args.json:
            write_text(args.json, json.dumps(report, indent=2) + "\n", what="the report")
            print(f"report written to {args.json}")
    dist.destroy_process_group()
    return 0


def run(args, rank, G, group, device) -> dict:
    trace = load(args.trace, rank)
    T, L_all, E = trace.counts_TLE.shape
    if not 1 <= args.layers <= L_all:
        raise EplbError(f"--layers must be 1..{L_all} (the trace's MoE layers), got {args.layers}")
    window = args.window % T
    layers = np.unique(np.linspace(0, L_all - 1, args.layers).round().astype(int))
    L = len(layers)
    counts_TLE = trace.counts_TLE[:, layers].astype(np.float64)
    freq_LE = counts_TLE[window]
    # Plan on history: every window but the one served (all of them if the trace has one).
    history = np.delete(counts_TLE, window, axis=0) if T > 1 else counts_TLE
    top_k = int(trace.meta.get("top_k") or 8)
    groups = int(trace.meta.get("num_expert_groups") or 1)
    cfg = ModelConfig(hidden=args.hidden, num_layers=L + 1, first_moe_layer=1, num_logical_experts=E, top_k=top_k,
                      num_expert_groups=groups, topk_groups=min(groups, int(trace.meta.get("topk_groups") or groups)),
                      expert_hidden=args.expert_hidden, num_shared_experts=0, name="ep-demo")
    result = plan(history, num_gpus=G, planner=args.planner, num_expert_groups=groups)
    planned = Placement(result.placement.phy2log_LP, G, E, layer_ids=trace.layer_ids[layers],
                        dispatch_weights_LP=result.placement.dispatch_weights_LP, planner=args.planner)
    topo = Topology(num_gpus=G, slots_per_gpu=planned.slots_per_gpu)
    contiguous = Placement(contiguous_map(E, topo, L), G, E, layer_ids=trace.layer_ids[layers])

    torch.manual_seed(args.seed)  # same weights on every rank
    moes = [MoE(cfg).to(device).requires_grad_(False) for _ in range(L)]
    eps = [ExpertParallelMoE.from_full(contiguous, l, m.w_gate_EFD, m.w_up_EFD, m.w_down_EDF, group=group,
                                       mode="even", sync_timing=device.type == "cuda")
           for l, m in enumerate(moes)]

    before = Recorder(L)
    err_before = run_phase(moes, eps, before, args, rank, device, freq_LE)
    rep_before = before.gather(group, device)

    dist.barrier(group)
    t0 = time.perf_counter()
    m0 = moes[0]
    expert_bytes = sum(t[0].numel() * t.element_size() for t in (m0.w_gate_EFD, m0.w_up_EFD, m0.w_down_EDF))
    mig = plan_migration(contiguous, planned, bytes_per_expert=expert_bytes)
    apply_placement(eps, planned, plan=mig, mode=args.mode)
    dist.barrier(group)
    move_s = time.perf_counter() - t0

    after = Recorder(L)
    err_after = run_phase(moes, eps, after, args, rank, device, freq_LE)
    rep_after = after.gather(group, device)

    err = torch.tensor([max(err_before, err_after)], dtype=torch.float64, device=device)
    dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)

    v3 = ModelConfig.deepseek_v3()
    sb, sa = rep_before.summary(), rep_after.summary()
    return {
        "straggler_tokens_before": sb["straggler_tokens"],
        "straggler_tokens_after": sa["straggler_tokens"],
        "straggler_time_before": sb["straggler_time"],
        "straggler_time_after": sa["straggler_time"],
        "max_abs_error_vs_reference": float(err.item()),
        "kv_bytes_per_token": {
            "note": "bf16 (2 bytes); MLA caches kv_lora_rank + rope dim per layer; GQA: 8 KV heads of 128",
            "deepseek_v3_mla": v3.kv_bytes_per_token(),
            "deepseek_v3_mha": v3.mha_kv_bytes_per_token(),
            "deepseek_v3_gqa8": v3.mha_kv_bytes_per_token(kv_heads=8, head_dim=128),
            "demo_model_mla": cfg.kv_bytes_per_token(),
            "demo_model_mha": cfg.mha_kv_bytes_per_token(),
        },
        "latency_ms_before": sb["step_latency_ms"],
        "latency_ms_after": sa["step_latency_ms"],
        "a2a_ms_per_step_before": sb["a2a_ms_per_step_rank"],
        "a2a_ms_per_step_after": sa["a2a_ms_per_step_rank"],
        "compute_ms_per_step_before": sb["compute_ms_per_step_rank"],
        "compute_ms_per_step_after": sa["compute_ms_per_step_rank"],
        "straggler_tokens_per_layer_before": sb["straggler_tokens_per_layer"],
        "straggler_tokens_per_layer_after": sa["straggler_tokens_per_layer"],
        "straggler_time_per_layer_before": sb["straggler_time_per_layer"],
        "straggler_time_per_layer_after": sa["straggler_time_per_layer"],
        "predicted_imbalance_on_window": {
            "contiguous": [round(float(x), 4) for x in _imb(contiguous, freq_LE)],
            "plan": [round(float(x), 4) for x in _imb(planned, freq_LE)],
        },
        "migration": {**mig.summary(), "seconds": round(move_s, 3)},
        "settings": {
            "trace": args.trace, "trace_synthetic": bool(trace.meta.get("synthetic")), "window": int(window),
            "plan_windows": int(history.shape[0]), "layer_ids": trace.layer_ids[layers].tolist(),
            "ranks": G, "experts": E, "slots_per_rank": planned.slots_per_gpu, "top_k": top_k,
            "tokens_per_rank_per_step": args.tokens, "steps": args.steps, "hidden": args.hidden,
            "expert_hidden": args.expert_hidden, "planner": args.planner, "mode_after": args.mode,
            "backend": dist.get_backend(group), "device": str(device), "plan_status": result.status,
        },
    }


def _imb(placement: Placement, load_LE: np.ndarray) -> np.ndarray:
    g = placement.gpu_loads(load_LE)
    return g.max(1) / g.mean(1)


def show(r: dict) -> None:
    rows = [("straggler ratio, tokens", r["straggler_tokens_before"], r["straggler_tokens_after"]),
            ("straggler ratio, compute time", r["straggler_time_before"], r["straggler_time_after"]),
            ("step latency p50 ms", r["latency_ms_before"]["p50"], r["latency_ms_after"]["p50"]),
            ("step latency p99 ms", r["latency_ms_before"]["p99"], r["latency_ms_after"]["p99"])]
    print(f"{'':32s} {'contiguous':>11s} {r['settings']['planner']:>11s}")
    for name, b, a in rows:
        print(f"{name:32s} {b:11.3f} {a:11.3f}")
    print(f"max |EP - reference| = {r['max_abs_error_vs_reference']:.2e}; "
          f"migration: {r['migration']['network_transfers']} transfers in {r['migration']['rounds']} rounds, "
          f"{r['migration']['seconds']} s; total {r['seconds_total']} s")


if __name__ == "__main__":
    sys.exit(main())
