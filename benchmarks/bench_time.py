"""Step time, not tokens: the time objective, the per-batch time dispatch, traffic-aware placement
and the calibration of the cost model, each beside its reference in one run.

    python benchmarks/bench_time.py [--traces ../shared/traces] [--write-docs] [--skip-shim]

Legend: L = MoE layers, E = logical experts, G = GPUs, B = tokens per step (whole group).

Part 1, decode (DeepSeek-V3 shape, H200, FP8 experts): placements are planned on one decode
  workload and scored on batches of B tokens drawn from the *other* one (both folds); the
  reference is token-balanced greedy with an even split, `--objective time` is greedy on the
  time objective served with the per-batch time dispatch. Figure: the busiest GPU's routed-expert
  time summed over layers (eplb.dispatch.cost), mean over batches; token ratios (busiest / mean GPU rows)
  beside it.
Part 2, traffic (DeepSeek-V2-Lite per-token prefill windows of 4096 tokens, 8 GPUs on 2 nodes,
  H200): node-blind greedy vs the `traffic` planner, planned on 8 windows and scored on the next
  8 (three folds); all-to-all bytes per token are exact from the tokens' own choices.
Part 3, the runtime shim on 4 gloo ranks (this machine): `eplb calibrate`'s 24 cases, the fit's
  R^2 in-sample and on held-out cases; then, in a run of their own, the measured compute-time
  straggler of the token objective (greedy + even) against the time objective (time plan + time
  dispatch) at 1-16 tokens per rank.
Part 4, speed: the time dispatch for 58 layers (numpy) against the token re-split, `simulate`
  at 58 x 256, and whether planning with the time objective imports torch.
Real traces are read from --traces when present; else the shipped synthetic trace (and a
synthetic per-token trace from eplb.stats.synth for Part 2), and the tables say so.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _report import write_results  # noqa: E402  (benchmarks/_report.py)

from eplb.commands.common import format_table  # noqa: E402
from eplb.core.trace import Trace  # noqa: E402
from eplb.dispatch.calibration import fit_profile, measured_compute  # noqa: E402
from eplb.dispatch.cost import TimeObjective, cost_model  # noqa: E402
from eplb.dispatch.rules import Resplitter, get_rule  # noqa: E402
from eplb.dispatch.timed import TimeDispatch, TimeSolver  # noqa: E402
from eplb.evaluate.simulate import cut_batches, score_batch, simulate  # noqa: E402
from eplb.formats import load_trace, save_placement  # noqa: E402
from eplb.planning.front_door import plan  # noqa: E402
from eplb.stats.synth import SynthSettings, generate  # noqa: E402

SYNTH = ROOT / "traces" / "deepseek.npz"


def decode_workloads(traces: Path) -> tuple[list[tuple[str, Trace]], str]:
    files = sorted((traces / "deepseek_v3_sglang").glob("decode_*.json"))
    if len(files) >= 2:
        return [(f.stem, load_trace(f)) for f in files[:2]], f"real: {traces / 'deepseek_v3_sglang'}"
    t = load_trace(SYNTH)
    dec = np.flatnonzero(np.array(t.meta.get("phases") or ["decode"] * t.num_windows) == "decode")
    halves = np.array_split(dec, 2)
    out = [(f"synthetic decode windows {h[0]}-{h[-1]}", Trace(t.counts_TLE[h].sum(axis=0)[None], t.layer_ids,
                                                                  dict(t.meta))) for h in halves]
    return out, f"{traces} not found: decode windows of the shipped synthetic trace {SYNTH.name}"


def part_decode(args, out: list[str]) -> dict:
    cost = cost_model("deepseek-v3", "h200")
    loads, source = decode_workloads(args.traces)
    configs = [("tokens + even (reference)", "tokens", "even"), ("tokens + time dispatch", "tokens", "time"),
               ("time plan + even", "time", "even"), ("--objective time", "time", "time")]
    rows, gains = [], {}
    for G in args.gpus:
        S = 288 // G
        for B in args.batch_tokens:
            for fold in range(2):
                (plan_name, plan_tr), (test_name, test_tr) = loads[fold], loads[1 - fold]
                batches, _ = cut_batches(test_tr, 8, B, args.batches, seed=fold)
                placements = {"tokens": plan(plan_tr, num_gpus=G, slots_per_gpu=S).placement,
                              "time": plan(plan_tr, num_gpus=G, slots_per_gpu=S,
                                           objective=TimeObjective(cost, batch_tokens=B)).placement}
                got = {}
                for label, pl_key, rule in configs:
                    pl = placements[pl_key]
                    bound = (TimeDispatch(cost) if rule == "time" else get_rule("even")).bind(pl)
                    steps = [score_batch(cost, pl, bound, b) for b in batches]
                    got[label] = (np.mean([s.busiest_compute_seconds for s in steps]),
                                  np.mean([s.straggler_tokens for s in steps]), np.mean([s.seconds for s in steps]))
                ref = got[configs[0][0]][0]
                gain = 1 - got["--objective time"][0] / ref
                gains.setdefault((G, B), []).append(gain)
                rows.append([G, B, f"{plan_name[:14]} -> {test_name[:14]}", 1e3 * ref,
                             *(f"{1e3 * got[c[0]][0]:.3f} ({got[c[0]][0] / ref - 1:+.1%})" for c in configs[1:]),
                             got[configs[0][0]][1], got["--objective time"][1],
                             1e3 * got[configs[0][0]][2], 1e3 * got["--objective time"][2]])
    table = format_table(["G", "B", "plan -> scored on", "reference ms", "tokens + time dispatch",
                          "time plan + even", "--objective time", "tokens ratio ref", "tokens ratio time",
                          "step ms ref", "step ms time"], rows)
    small = [g for (G, B), v in gains.items() if B <= 32 for g in v]
    large = [g for (G, B), v in gains.items() if B >= 128 for g in v]
    verdict = [f"target: >= 12% lower busiest-GPU expert time at B = 16-32, G = 16 and 32 -> lowest over those "
               f"cases and folds {min(small):.1%} ({'met' if min(small) >= 0.12 else 'NOT met'})" if small else "",
               f"target: never worse at B = 128 -> smallest cut {min(large):.1%} "
               f"({'met' if min(large) >= 0 else 'NOT met'})" if large else ""]
    out += [f"## Part 1: decode, time objective vs token-balanced greedy ({source})", "",
            f"DeepSeek-V3 shape on H200 (FP8 experts, eplb.dispatch.cost); {args.batches} batches of B tokens (whole "
            f"group) drawn from the held-out workload's expert frequencies per case (independent choices); "
            f"288 slots. Columns 4-7: busiest GPU's routed-expert time summed over 58 layers, mean over "
            f"batches (change against the reference). 'tokens ratio': busiest / mean GPU rows. 'step ms': "
            f"modeled MoE step time with dispatch and combine.", "", "```", table, "```", ""]
    out += [v for v in verdict if v] + [""]
    return {"small": small, "large": large}


def v2_lite_trace(traces: Path, tokens_per_window: int) -> tuple[Trace, str, str]:
    path = traces / "deepseek_v2_lite_per_token" / "per_token_topk.npz"
    if path.is_file():
        with np.load(path, allow_pickle=False) as z:
            keys = sorted(z.files, key=lambda k: int(re.sub(r"\D", "", k) or 0))
            topk_NLK = np.ascontiguousarray(np.concatenate([z[k] for k in keys], axis=1).transpose(1, 0, 2))
        N = len(topk_NLK) // tokens_per_window * tokens_per_window
        topk_NLK, win = topk_NLK[:N].astype(np.int16), np.arange(N) // tokens_per_window
        T, L, E = N // tokens_per_window, topk_NLK.shape[1], 64
        flat = (win[:, None, None] * L * E + np.arange(L)[None, :, None] * E + topk_NLK).ravel()
        counts = np.bincount(flat, minlength=T * L * E).reshape(T, L, E)
        meta = {"model": "DeepSeek-V2-Lite", "num_hidden_layers": 27, "num_experts": E, "top_k": 6,
                "num_expert_groups": None, "tokens_per_window": tokens_per_window, "source": str(path),
                "synthetic": False}
        return (Trace(counts, np.arange(1, L + 1), meta, topk_NLK, win.astype(np.int32)), "deepseek-v2-lite",
                f"real: {path.name}, {N:,} tokens in {T} windows of {tokens_per_window}")
    t = generate(SynthSettings(num_windows=24, tokens_per_window=tokens_per_window, keep_tokens=tokens_per_window))
    return t, "deepseek-v3", f"{path} not found: eplb.stats.synth per-token DeepSeek-V3-shaped trace (24 windows)"


def _sub(trace: Trace, t0: int, t1: int) -> Trace:
    m = (trace.token_window_N >= t0) & (trace.token_window_N < t1)
    return Trace(trace.counts_TLE[t0:t1], trace.layer_ids, dict(trace.meta), trace.topk_ids_NLK[m],
                 trace.token_window_N[m] - t0)


def part_traffic(args, out: list[str]) -> dict:
    trace, model, source = v2_lite_trace(args.traces, 4096)
    cost = cost_model(model, "h200")
    G, N = 8, 2
    S = -(-trace.num_logical_experts // G) + 1
    rows, cuts, steps = [], [], []
    # Three folds: plan on 8 windows, score the next 8 (the last fold ends at the last window).
    folds = [(s, s + 8, s + 16) for s in np.linspace(0, trace.num_windows - 16, 3).astype(int)]
    for a, b, c in folds:
        hist, test = _sub(trace, a, b), _sub(trace, b, c)
        res = {}
        for name, planner, settings in (("greedy (node-blind)", "greedy", None),
                                        ("traffic, tolerance 0.01", "traffic", {"tolerance": 0.01}),
                                        ("traffic, tolerance 0.02", "traffic", {"tolerance": 0.02})):
            t0 = time.perf_counter()
            r = plan(hist, num_gpus=G, num_nodes=N, slots_per_gpu=S, planner=planner, settings=settings)
            secs = time.perf_counter() - t0
            s = simulate(cost, r.placement, test, rule="even").summary()
            res[name] = s
            a2a, ref = s["all_to_all_bytes_per_token"], res["greedy (node-blind)"]
            inter_cut = 1 - a2a["inter_node"] / ref["all_to_all_bytes_per_token"]["inter_node"]
            step_ratio = s["moe_step_seconds"] / ref["moe_step_seconds"]
            rows.append([f"{a}-{b - 1} -> {b}-{c - 1}", name, a2a["inter_node"] / 1e3, f"{-inter_cut:+.1%}",
                         a2a["intra_node"] / 1e3, 1e3 * s["moe_step_seconds"], f"{step_ratio - 1:+.1%}",
                         1e3 * s["busiest_gpu_expert_seconds"], s["straggler_tokens"], secs])
            if name == "traffic, tolerance 0.02":
                cuts.append(inter_cut)
                steps.append(step_ratio)
    table = format_table(["windows plan -> scored", "placement", "inter-node KB/token", "vs greedy",
                          "NVLink KB/token", "MoE step ms", "vs greedy", "busiest-GPU experts ms",
                          "tokens ratio", "plan s"], rows)
    out += [f"## Part 2: traffic-aware placement ({source})", "",
            f"{G} GPUs on {N} nodes, {G * S} slots, {cost.model.name} on H200 (FP8 experts, DeepEP-style dispatch "
            f"fp8 / combine bf16, once per destination GPU); each held-out window is one batch of 4096 tokens, "
            f"even split; bytes per token summed over the layers.", "", "```", table, "```", "",
            f"target: >= 20% fewer inter-node bytes per token than node-blind greedy at modeled step time "
            f"within 2% (tolerance 0.02) -> inter-node cut {min(cuts):.1%} to {max(cuts):.1%} over "
            f"{len(cuts)} folds, step time {min(steps) - 1:+.1%} to {max(steps) - 1:+.1%} "
            f"({'met' if min(cuts) >= 0.2 and max(steps) <= 1.02 else 'NOT met'})", ""]
    return {"cuts": cuts, "steps": steps}


def part_shim(args, out: list[str]) -> dict:
    from eplb.runtime.calibrate import ShimSettings, default_cases, measure  # imports torch: only for Part 3

    settings = ShimSettings()
    cases = default_cases(4, settings=settings)
    t0 = time.perf_counter()
    m = measure(cases, 4, settings, backend="gloo")
    secs = time.perf_counter() - t0
    hw, rep = fit_profile(m, name="calibrated (gloo, 4 ranks)")
    y = measured_compute(m)                                               # [C, G] ms per step
    pred = np.array(rep["predicted_ms_CG"]) / 1e3
    rows = [[n, 1e3 * y[i].max(), 1e3 * pred[i].max(), y[i].max() / y[i].mean()] for i, n in enumerate(m.names)]
    # The objectives side by side: a run of their own, longer (10 steps), cases interleaved.
    cmp_settings = ShimSettings(steps=10)
    cmp_cases = [c for c in default_cases(4, settings=cmp_settings, tokens_per_rank=(1, 2, 4, 8, 16))
                 if c.name.startswith(("greedy tokens", "greedy time"))]
    mc = measure(cmp_cases, 4, cmp_settings, backend="gloo")
    # Per step, each layer waits for its busiest rank: sum over layers of the busiest, mean over steps.
    straggler_C = mc.compute_s_CBLG.max(axis=3).sum(axis=2).mean(axis=1)
    ratio_C = (mc.compute_s_CBLG.max(axis=3).sum(axis=2) / mc.compute_s_CBLG.mean(axis=3).sum(axis=2)).mean(axis=1)
    cmp_rows, wins = [], []
    for T in (1, 2, 4, 8, 16):
        i_tok = mc.names.index(f"greedy tokens + even, {T} tokens/rank")
        i_time = mc.names.index(f"greedy time + time dispatch, {T} tokens/rank")
        a, b = straggler_C[i_tok], straggler_C[i_time]
        cmp_rows.append([T, 4 * T, 1e3 * a, 1e3 * b, f"{b / a - 1:+.1%}", ratio_C[i_tok], ratio_C[i_time]])
        if T <= 8:
            wins.append(b < a)
    out += ["## Part 3: the runtime shim, 4 gloo ranks on this machine", "",
            f"`eplb calibrate`'s default cases ({len(cases)}: 4 placements x 6 batch sizes, {settings.steps} "
            f"steps each, D={settings.hidden}, F={settings.expert_hidden}, 32 experts, top-{settings.top_k}, "
            f"2 layers, fp32) in {secs:.0f} s. Expert time: CPU time of each rank's thread.", "",
            f"fit: overhead {1e6 * hw.expert_overhead_s:.0f} us per active replica, {hw.flops('fp32') / 1e9:.1f} "
            f"GFLOP/s, {hw.hbm_bytes_per_s / 1e9:.0f} GB/s; all-to-all latency {1e3 * hw.a2a_latency_s:.1f} ms "
            f"per phase, {hw.nvlink_bytes_per_s / 1e6:.0f} MB/s", "",
            f"R^2 of per-rank expert time per step ({rep['points']} rank x case points): {rep['r2_compute']:.3f} "
            f"in-sample, {rep['r2_compute_held_out']:.3f} on held-out cases (fit on even cases, predict odd); "
            f"all-to-all {rep['r2_all_to_all']:.3f} (gloo over loopback on a shared machine)", "",
            f"target: R^2 >= 0.8 across >= 20 placement x batch cases -> {rep['r2_compute_held_out']:.3f} held out "
            f"({'met' if rep['r2_compute_held_out'] >= 0.8 and len(cases) >= 20 else 'NOT met'})", "",
            "```", format_table(["case", "busiest rank measured ms", "predicted ms", "measured max/mean"], rows), "```",
            "", "Token objective (greedy + even split) against the time objective (greedy on the time objective, "
            "per-step time dispatch with the `cpu` profile), measured in one run of their own (10 steps per case, "
            "cases interleaved). Straggler: per step, the busiest rank's expert time in each layer, summed over "
            "layers; mean over steps. max/mean: the same busiest over the mean rank.", "", "```",
            format_table(["tokens/rank", "tokens/step", "tokens: straggler ms", "time: straggler ms", "change",
                          "tokens: max/mean", "time: max/mean"], cmp_rows), "```", "",
            f"target: the measured compute-time straggler is lower with the time objective at small batches (1-8 "
            f"tokens per rank, 4-32 per step) -> {sum(wins)} of {len(wins)} batch sizes "
            f"({'met' if wins and all(wins) else 'NOT met'})", ""]
    return {"r2": rep["r2_compute_held_out"], "wins": wins}


def _timed(f, repeats: int, inputs=None) -> tuple[float, float]:
    """Median wall and CPU seconds of f() (or f(x) for x cycling through `inputs`)."""
    wall, cpu = [], []
    for i in range(repeats):
        x = None if inputs is None else inputs[i % len(inputs)]
        t0, c0 = time.perf_counter(), time.process_time()
        f() if inputs is None else f(x)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return float(np.median(wall)), float(np.median(cpu))


def part_speed(args, out: list[str]) -> dict:
    cost = cost_model("deepseek-v3", "h200")
    name, tr = decode_workloads(args.traces)[0][0]
    pl = plan(tr, num_gpus=32, slots_per_gpu=9).placement
    batches, _ = cut_batches(tr, 8, 32, 50, seed=0)
    t0 = time.perf_counter()
    solver = TimeSolver(pl, cost)
    bind_s = time.perf_counter() - t0
    # A fresh process's first batch: eplb's imports, the binding and one call.
    load = ("import time; t0 = time.perf_counter(); import numpy as np; from eplb.core.placement import Placement; "
            "from eplb.dispatch.cost import cost_model; from eplb.dispatch.timed import TimeDispatch; "
            "p = Placement(np.array([[0, 1, 0, 2]]), 2, 3); "
            "TimeDispatch(cost_model('deepseek-v3', 'h200')).bind(p)(np.array([[3.0, 1.0, 0.0]])); "
            "print(time.perf_counter() - t0)")
    first_s = float(subprocess.run([sys.executable, "-c", load], check=True, capture_output=True, text=True,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout)
    rs = Resplitter(pl)
    rules = (("time dispatch", lambda b: solver(b.counts_LE)),
             ("token re-split, 1 sweep", lambda b: rs(b.counts_LE, 1)),
             ("token re-split, 8 sweeps", lambda b: rs(b.counts_LE, 8)))
    # Interleaved rounds, so that the machine's load falls on every rule alike.
    times = {label: ([], []) for label, _ in rules}
    for _ in range(10):
        for label, f in rules:
            w, c = _timed(f, 20, batches)
            times[label][0].append(w)
            times[label][1].append(c)
    ref = float(np.median(times["token re-split, 1 sweep"][0]))
    rows = [[label, 1e3 * np.median(w), 1e3 * np.median(c), np.median(w) / ref] for label, (w, c) in times.items()]
    sim_w, _ = _timed(lambda: simulate(cost, pl, tr, rule="even", batch_tokens=4096), 5)
    sim_t, _ = _timed(lambda: simulate(cost, pl, tr, rule="time", batch_tokens=32), 3)
    pl_path = Path(args.tmp) / "bench_time_plan.json"
    save_placement(pl, pl_path)
    trace_path = next(iter(sorted((args.traces / "deepseek_v3_sglang").glob("decode_*.json"))), SYNTH)
    cmd = [sys.executable, "-m", "eplb", "simulate", str(trace_path), "--plan", str(pl_path), "--model",
           "deepseek-v3", "--hardware", "h200", "--json"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    cli = time.perf_counter() - t0
    probe = ("import sys, numpy as np; from eplb.planning import plan; from eplb.dispatch.cost import TimeObjective, "
             "cost_model; from eplb.evaluate.simulate import simulate; from eplb.formats import load_trace; "
             f"t = load_trace({str(trace_path)!r}); "
             "r = plan(t, num_gpus=32, slots_per_gpu=9, objective=TimeObjective(cost_model('deepseek-v3', 'h200'))); "
             "simulate(cost_model('deepseek-v3', 'h200'), r.placement, t, rule='time', batch_tokens=32); "
             "print('torch' in sys.modules)")
    torch_loaded = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.strip()
    out += ["## Part 4: speed (58 layers x 256 experts, 32 GPUs, 288 slots; this 2-core shared machine)", "",
            "```", format_table(["per-batch rule (58 layers, 32-token batches)", "median wall ms", "median CPU ms",
                                 "vs token re-split, 1 sweep"], rows),
            "```", "",
            f"Medians over 10 interleaved rounds of 20 batches (50 batches of 32 tokens cut from {name}, greedy "
            f"plan). Binding the time dispatch to the placement (its index tables, once per placement): "
            f"{1e3 * bind_s:.0f} ms; a fresh process's first batch (eplb's imports, binding, one call; numpy "
            f"only, nothing to compile): {first_s:.2f} s.", "",
            f"target: the per-batch time dispatch ~1 ms for 58 layers -> {rows[0][1]:.2f} ms median wall, "
            f"{rows[0][3]:.2f}x the token re-split's one sweep ({'met' if rows[0][1] <= 1.0 else 'NOT met'})", "",
            f"`simulate` in-process on {name} (58 x 256): {1e3 * sim_w:.0f} ms with the default 8 batches of "
            f"4096 tokens under the even split, {1e3 * sim_t:.0f} ms with 8 batches of 32 tokens under the time "
            f"dispatch; the `eplb simulate ... --json` command end to end (interpreter start and imports "
            f"included): {cli:.2f} s", "",
            f"torch imported after planning with the time objective and simulating: {torch_loaded}", ""]
    return {"dispatch_ms": rows[0][1], "simulate_s": sim_w, "cli_s": cli, "torch": torch_loaded}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces")
    ap.add_argument("--gpus", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--batch-tokens", type=int, nargs="+", default=[16, 32, 128])
    ap.add_argument("--batches", type=int, default=64, help="batches per case in Part 1")
    ap.add_argument("--skip-shim", action="store_true", help="skip Part 3 (starts 4 processes, ~1-2 minutes)")
    ap.add_argument("--skip-traffic", action="store_true")
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--write-docs", action="store_true", help="write the tables to docs/results/time.md")
    args = ap.parse_args(argv)
    out = ["# Step time, not tokens: benchmark results", "",
           f"Written by `python benchmarks/bench_time.py{' --skip-shim' if args.skip_shim else ''} --write-docs` on "
           f"{datetime.date.today()} ({os.cpu_count()} cores, shared with other jobs: read ratios, and timings as "
           f"upper bounds). Cost model and assumptions: [docs/cost-model.md](../cost-model.md).", ""]
    t0 = time.perf_counter()
    for part in (part_decode, *(() if args.skip_traffic else (part_traffic,)),
                 *(() if args.skip_shim else (part_shim,)), part_speed):
        n = len(out)
        part(args, out)
        print("\n".join(out[n:]), flush=True)
    print(f"bench_time: {time.perf_counter() - t0:.0f} s")
    if args.write_docs:
        path = write_results("time", "\n".join(out).rstrip() + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
