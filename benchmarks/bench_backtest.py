"""Held-out balance of each planner: leave-one-workload-out on real DeepSeek-V3 loads, and a
sequential backtest on per-token DeepSeek-V2-Lite windows.

    python benchmarks/bench_backtest.py                       # all real data found under ../shared
    python benchmarks/bench_backtest.py --gpus 32 --quick     # one GPU count, even + resplit only

Legend: L = MoE layers, E = logical experts, G = GPUs, T = windows.

Part 1: for each of the 8 SGLang DeepSeek-V3 workloads, plan on the other 7 (as 7 history
windows) and score on the one left out; median over held-out workloads of busiest / mean GPU
(itself the median over the 58 layers), per planner and dispatch policy: even split, dynamic
re-split per window with the fast `resplit` rule, and the exact LP split (`optimal`).
Part 2: DeepSeek-V2-Lite per-token selections cut into windows of ~4k tokens (in prompt order),
replayed in order: plan on the last 8 windows, serve the next 4. Without ../shared (a user's
clone), both parts run on the shipped synthetic trace instead and say so.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _report import add_write_docs, results_page  # noqa: E402  (benchmarks/_report.py)

from eplb.commands.common import format_table  # noqa: E402
from eplb.evaluate.backtest import backtest, leave_one_out  # noqa: E402
from eplb.formats import load_trace  # noqa: E402

SHARED = ROOT.parent / "shared" / "traces"
V3_DIR = SHARED / "deepseek_v3_sglang"
V2_FILE = SHARED / "deepseek_v2_lite_per_token" / "per_token_topk.npz"
SYNTH = ROOT / "traces" / "deepseek.npz"


def slots_for(num_gpus: int, experts: int) -> int:
    """Slots per GPU: 288 slots (32 redundant) where G divides 288, else one redundant per GPU."""
    if 288 % num_gpus == 0 and experts == 256:
        return 288 // num_gpus
    return -(-experts // num_gpus) + 1


def v3_workloads(quiet: bool) -> tuple[list, list[str], str]:
    if V3_DIR.is_dir() and sorted(V3_DIR.glob("*.json")):
        files = sorted(V3_DIR.glob("*.json"))
        return [load_trace(f) for f in files], [f.stem for f in files], f"real: {V3_DIR}"
    trace = load_trace(SYNTH)
    parts = np.array_split(np.arange(trace.num_windows), 8)
    names = [f"synthetic windows {p[0]}-{p[-1]}" for p in parts]
    return ([trace.counts_TLE[p].sum(axis=0)[None] for p in parts], names,
            f"{V3_DIR} not found: 8 pseudo-workloads from the shipped synthetic trace {SYNTH.name}")


def v2_lite_windows(path: Path, tokens_per_window: int) -> tuple[np.ndarray, str]:
    """Counts [T, 26, 64] from per-token top-k ids, prompts in numeric order, ~4k tokens a window."""
    with np.load(path, allow_pickle=False) as z:
        keys = sorted(z.files, key=lambda k: int(re.sub(r"\D", "", k) or 0))
        topk_LNK = np.concatenate([z[k] for k in keys], axis=1).astype(np.int64)
    L, N, K = topk_LNK.shape
    E = 64
    T = N // tokens_per_window
    ids = topk_LNK[:, :T * tokens_per_window].reshape(L, T, tokens_per_window * K)
    flat = (np.arange(T)[None, :, None] * L * E + np.arange(L)[:, None, None] * E + ids).ravel()
    counts_TLE = np.bincount(flat, minlength=T * L * E).reshape(T, L, E)
    return counts_TLE, f"real: {path.name}, {len(keys)} prompts, {N:,} tokens -> {T} windows of {tokens_per_window}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--planners", nargs="+", default=["contiguous", "deepseek", "greedy", "robust"])
    ap.add_argument("--with-ilp", type=float, metavar="SECONDS",
                    help="also run the ilp planner with this time budget per plan (slow)")
    ap.add_argument("--quick", action="store_true", help="skip the exact LP split (even + resplit only)")
    ap.add_argument("--v2-gpus", type=int, default=8)
    ap.add_argument("--v2-window", type=int, default=4096, help="tokens per V2-Lite window")
    ap.add_argument("--skip-v2", action="store_true")
    add_write_docs(ap, "backtest")
    args = ap.parse_args(argv)
    with results_page("backtest", "Backtests: held-out traffic", args.write_docs, argv):
        return run(args)


def run(args) -> int:
    """The benchmark itself: print its tables (main() adds the results page)."""
    dispatch = ("even", "resplit") if args.quick else ("even", "resplit", "optimal")
    planners = list(args.planners) + (["ilp"] if args.with_ilp else [])
    settings = {"ilp": {"time_limit": args.with_ilp, "quiet": True}} if args.with_ilp else {}

    workloads, names, source = v3_workloads(quiet=True)
    print(f"# Part 1: leave-one-workload-out, DeepSeek-V3 ({source})")
    print(f"# cores: {os.cpu_count()}; max/mean = busiest / mean GPU, median over layers, then median over "
          f"the {len(workloads)} held-out workloads")
    per_workload = {}
    for G in args.gpus:
        S = slots_for(G, 256)
        rows = []
        for name in planners:
            t0 = time.perf_counter()
            r = leave_one_out(workloads, num_gpus=G, slots_per_gpu=S, planner=name, labels=names, dispatch=dispatch,
                              settings=settings.get(name), num_expert_groups=8, oracle=False, quiet=True)
            s = r.summary()
            imb = s["median"]["imbalance"]
            rows.append([name, *(imb[d] for d in dispatch), 100 * s["median"]["optimisation_gap"]["even"],
                         1e3 * s["plan_seconds_median"], time.perf_counter() - t0])
            if G == 32:
                per_workload[name] = r.column("imbalance")
        print(f"\n{G} GPUs, {G * S} slots ({S} per GPU):")
        print(format_table(["planner", *(f"{d} max/mean" for d in dispatch), "opt. gap even %",
                            "ms/plan", "bench s"], rows))
        if "deepseek" in planners:
            print("deepseek = DeepSeek's EPLB algorithm (planners/deepseek.py) on the summed history, "
                  "8 expert groups, hierarchical policy")
    if per_workload:
        print("\n32 GPUs, per held-out workload (max/mean, " + " / ".join(dispatch) + "):")
        rows = [[n, *(" / ".join(f"{v:.3f}" for v in per_workload[p][i]) for p in per_workload)]
                for i, n in enumerate(names)]
        print(format_table(["held out", *per_workload], rows))

    if args.skip_v2:
        return 0
    if V2_FILE.is_file():
        counts, source = v2_lite_windows(V2_FILE, args.v2_window)
        E = 64
    else:
        counts = load_trace(SYNTH).counts_TLE
        E = counts.shape[2]
        source = f"{V2_FILE} not found: shipped synthetic trace {SYNTH.name}"
    G = args.v2_gpus
    S = slots_for(G, E)
    print(f"\n# Part 2: sequential backtest ({source}); {G} GPUs, {G * S} slots; "
          f"plan on the last 8 windows, serve the next 4")
    rows = []
    for name in planners:
        t0 = time.perf_counter()
        r = backtest(counts, num_gpus=G, slots_per_gpu=S, planner=name, interval=4, history=8, dispatch=dispatch,
                     settings=settings.get(name), oracle=False, quiet=True)
        s = r.summary()
        rows.append([name, *(s["median"]["imbalance"][d] for d in dispatch),
                     *(s["median"]["bound_ratio"][d] for d in dispatch[:1]),
                     1e3 * s["plan_seconds_median"], time.perf_counter() - t0])
    print(format_table(["planner", *(f"{d} max/mean" for d in dispatch), "even max/bound", "ms/plan", "bench s"],
                       rows))
    print(f"{len(r.windows)} held-out windows, {len(r.plans)} plans; medians over windows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
