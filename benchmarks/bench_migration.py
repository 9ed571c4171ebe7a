"""Migration-aware rebalancing: moves against balance, schedules, and the serving hook's cost.

Run (from the repository root; real data from ../shared/traces when present):

    python benchmarks/bench_migration.py
    python benchmarks/bench_migration.py --v3-dir ../shared/traces/deepseek_v3_sglang \
        --v2-lite ../shared/traces/deepseek_v2_lite_per_token/per_token_topk.npz --budget 0.15

Legend: L = MoE layers, E = logical experts, G = GPUs, P = physical slots, T = windows.

Part 1 (DeepSeek-V3, 32 GPUs, 288 slots): for every ordered pair of workloads (A, B), the
greedy plan made for A is serving when traffic becomes B. Compared: a from-scratch greedy
replan for B (moves as planned, and after optimal relabelling), and the move-budgeted plan
(`eplb.plan(..., previous=plan_A, budget=Budget(max_moves=budget x scratch moves))`). Medians over pairs.
Part 2 (DeepSeek-V2-Lite per-token, 8 GPUs, 72 slots): windows of ~4k tokens in prompt order;
the Rebalancer observes each window and rebalances when due; every window is scored with
the placement chosen *before* it was seen. Compared with a static plan and a from-scratch
replan after every window.
Part 3 (DeepSeek-V3 shape): cost of observe(), of the decision check and of rebalance(), and
how long a serving thread is held up (GIL) while rebalance() runs on a side thread.
Part 4 (DeepSeek-V3, 32 GPUs on 4 nodes, 8 expert groups): the node-aware (hierarchical) plan
for A is serving when traffic becomes B; the move-budgeted search at several `span_cost`
prices against a from-scratch hierarchical plan for B: balance, group span (nodes holding a
replica of each expert group), moves, decision time.
Without the real files, parts 1, 2 and 4 fall back to the shipped synthetic trace (traces/deepseek.npz).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
os.environ.setdefault("EPLB_JIT", "wait")  # timings of machine code (compiled at first call)

from _report import add_write_docs, results_page  # noqa: E402

from eplb import migration as mg  # noqa: E402
from eplb import plan  # noqa: E402
from eplb.commands.common import format_table  # noqa: E402
from eplb.core.placement import Placement  # noqa: E402
from eplb.core.topology import Topology  # noqa: E402
from eplb.serving.rebalance import Rebalancer  # noqa: E402
from tests.oracles.migration import schedule as python_schedule  # noqa: E402

SHARED = os.path.join(os.path.dirname(ROOT), "shared", "traces")
SYNTH = os.path.join(ROOT, "traces", "deepseek.npz")


def imbalance(load_LE, phy2log_LP, num_gpus):
    """(median over layers of busiest/mean GPU, sum of busiest / sum of mean) under even dispatch."""
    mx = mg.max_load(load_LE, phy2log_LP, num_gpus)
    mean = load_LE.sum(axis=1) / num_gpus
    return float(np.median(mx / mean)), float(mx.sum() / mean.sum())


def v3_workloads(directory):
    from eplb.formats import load_trace

    files = sorted(glob.glob(os.path.join(directory, "*.json"))) if directory else []
    if files:
        return {os.path.basename(f)[:-5]: load_trace(f).counts_TLE.sum(axis=0).astype(float) for f in files}, directory
    c = load_trace(SYNTH).counts_TLE.astype(float)
    # 8 synthetic "workloads": consecutive quarters of the windows.
    return {f"synthetic windows {i * 4}-{i * 4 + 3}": c[i * 4:(i + 1) * 4].sum(axis=0) for i in range(8)}, SYNTH


def part1(args):
    loads, source = v3_workloads(args.v3_dir)
    names = list(loads)
    G, R = 32, 32
    print(f"\n## Part 1: rebalancing between workloads (DeepSeek-V3, {G} GPUs, {256 + R} slots)")
    print(f"source: {source} ({len(names)} workloads, {len(names) * (len(names) - 1)} ordered pairs); "
          f"budget = {args.budget:.0%} of the from-scratch replan's moves")
    plans = {n: plan(loads[n], num_gpus=G, num_redundant=R).placement for n in names}
    E = next(iter(loads.values())).shape[1]
    rows = []
    for a in names:
        for b in names:
            if a == b:
                continue
            prev, load = plans[a], loads[b]
            scratch = plans[b].phy2log_LP
            moves_scratch = int(mg.count_moves(prev.phy2log_LP, scratch, G, E).sum())
            budget = int(args.budget * moves_scratch)
            t0 = time.perf_counter()
            res = plan(load, num_gpus=G, num_redundant=R, previous=prev, budget=mg.Budget(max_moves=budget))
            dt = time.perf_counter() - t0
            info = res.info["migration"]
            new = res.placement.phy2log_LP
            t1 = time.perf_counter()
            sched = mg.schedule(prev.phy2log_LP, new, G, E)
            dts = time.perf_counter() - t1
            s_med, s_sum = imbalance(load, scratch, G)
            b_med, b_sum = imbalance(load, new, G)
            o_med, o_sum = imbalance(load, prev.phy2log_LP, G)
            rows.append(dict(
                pair=f"{a} -> {b}", scratch_moves=moves_scratch, relabeled=info["moves_relabeled"],
                moves=info["moves"], stale=o_med, scratch=s_med, budgeted=b_med,
                ratio_med=b_med / s_med, ratio_sum=b_sum / s_sum, seconds=dt,
                rounds=sched.num_rounds, in_max=int(mg.count_moves(prev.phy2log_LP, new, G, E).sum(axis=0).max()),
                staging=int(sched.staging_M.sum()), sched_s=dts))
    med = {k: float(np.median([r[k] for r in rows])) for k in rows[0] if k != "pair"}
    worst = max(rows, key=lambda r: r["ratio_med"])
    print(format_table(
        ["plan for B (medians over pairs)", "moves", "% of scratch", "busiest/mean GPU (median layer)",
         "vs scratch"],
        [["stale plan for A (no migration)", 0, 0.0, med["stale"], med["stale"] / med["scratch"]],
         ["from-scratch greedy, as planned", med["scratch_moves"], 100.0, med["scratch"], 1.0],
         ["from-scratch greedy, relabelled", med["relabeled"], 100 * med["relabeled"] / med["scratch_moves"],
          med["scratch"], 1.0],
         [f"move-budgeted ({args.budget:.0%} budget)", med["moves"], 100 * med["moves"] / med["scratch_moves"],
          med["budgeted"], med["ratio_med"]]]))
    print(f"budgeted / scratch busiest-GPU ratio: median {med['ratio_med']:.4f}, worst pair "
          f"{worst['ratio_med']:.4f} ({worst['pair']}); on summed loads (1 / balancedness) median "
          f"{med['ratio_sum']:.4f}, worst {max(r['ratio_sum'] for r in rows):.4f}")
    print(f"pairs within 2% of scratch (median layer): {sum(r['ratio_med'] <= 1.02 for r in rows)}/{len(rows)}")
    print(f"schedule: median {med['rounds']:.0f} rounds (lower bound = most copies onto one GPU: "
          f"{med['in_max']:.0f}), {med['staging']:.0f} staging copies")
    print(format_table(["time per pair (budgeted plan)", "median ms", "max ms"], [
        ["decision: greedy + relabel + search", med["seconds"] * 1e3, max(r["seconds"] for r in rows) * 1e3],
        ["migration schedule (rounds)", med["sched_s"] * 1e3, max(r["sched_s"] for r in rows) * 1e3]]))


def v2_windows(path, tokens):
    if path and os.path.exists(path):
        z = np.load(path, allow_pickle=False)
        keys = sorted(z.files, key=lambda k: int(k.split("_")[-1]))
        blocks, counts, n = [], [], 0
        E = 64
        for k in keys:
            a = z[k].astype(np.int64)                         # [L, T, K]
            blocks.append(a)
            n += a.shape[1]
            if n >= tokens:
                x = np.concatenate(blocks, axis=1)
                L = x.shape[0]
                c = np.zeros((L, E))
                np.add.at(c, (np.repeat(np.arange(L), x.shape[1] * x.shape[2]), x.reshape(L, -1).ravel()), 1)
                counts.append(c)
                blocks, n = [], 0
        return np.stack(counts), f"{path} (DeepSeek-V2-Lite, {len(counts)} windows of >= {tokens} tokens)", 8, 8
    from eplb.formats import load_trace

    c = load_trace(SYNTH).counts_TLE.astype(float)
    return c, f"{SYNTH} (synthetic DeepSeek-V3 shape, {len(c)} windows)", 32, 32


def part2(args):
    counts_TLE, source, G, R = v2_windows(args.v2_lite, args.tokens)
    T, L, E = counts_TLE.shape
    print(f"\n## Part 2: the Rebalancer over time ({source}; {G} GPUs, {E + R} slots)")
    start = plan(counts_TLE[0], num_gpus=G, num_redundant=R).placement
    rb = Rebalancer(start, window=args.history, interval=1, min_improvement=args.min_improvement,
                    budget=mg.Budget(move_cost=args.move_cost), policy=None)
    static_phy = start.phy2log_LP
    replan_phy = start.phy2log_LP
    bal = {"static": [], "replan": [], "rebalancer": []}
    moves_replan, moves_rb, times, checks, dec, sch = [], [], [], [], [], []
    for t in range(1, T):
        load = counts_TLE[t]
        # Score the placement each policy chose before seeing window t.
        for name, phy in (("static", static_phy), ("replan", replan_phy), ("rebalancer", rb.placement.phy2log_LP)):
            mx = mg.max_load(load, phy, G)
            bal[name].append(load.sum() / G / mx.sum())
        # Then let each policy learn from window t.
        new = plan(counts_TLE[max(1, t - args.history + 1):t + 1].sum(axis=0), num_gpus=G,
                   num_redundant=R).placement.phy2log_LP
        moves_replan.append(int(mg.count_moves(replan_phy, new, G, E).sum()))
        replan_phy = new
        t0 = time.perf_counter()
        due = rb.observe(load)
        checks.append(time.perf_counter() - t0)
        if due:
            t0 = time.perf_counter()
            res = rb.rebalance()
            times.append(time.perf_counter() - t0)
            moves_rb.append(res.moves)
            dec.append(res.info["decision_seconds"])
            sch.append(res.info["schedule_seconds"])
    q = lambda x: [float(np.min(x)), float(np.median(x)), float(np.mean(x)), float(np.max(x))]  # noqa: E731
    print(format_table(
        ["policy", "balancedness min", "median", "mean", "max", "moves / window", "rebalances"],
        [["static (plan on window 0)", *q(bal["static"]), 0.0, 0],
         ["from-scratch replan every window", *q(bal["replan"]), float(np.mean(moves_replan)), T - 1],
         ["Rebalancer (move_cost budget)", *q(bal["rebalancer"]), float(np.sum(moves_rb) / (T - 1)), len(moves_rb)]]))
    if moves_rb:
        print(f"Rebalancer: {len(moves_rb)} rebalances in {T - 1} windows, moves per rebalance median "
              f"{np.median(moves_rb):.0f} (max {max(moves_rb)}); from-scratch replan moves per window median "
              f"{np.median(moves_replan):.0f}")
        print(f"decision time: observe+check median {np.median(checks) * 1e3:.2f} ms; rebalance() median "
              f"{np.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms (decision median "
              f"{np.median(dec) * 1e3:.1f} ms, schedule median {np.median(sch) * 1e3:.1f} ms)")
    # Balancedness over time, in 8 equal slices of the run.
    slices = np.array_split(np.arange(T - 1), 8)
    print("balancedness over time (mean per eighth of the run):")
    print(format_table(["policy"] + [f"{s[0] + 1}-{s[-1] + 1}" for s in slices],
                       [[k] + [float(np.mean(np.asarray(v)[s])) for s in slices] for k, v in bal.items()]))


def serving_stall(fn):
    """Run fn on a side thread while this thread sleeps 0.2 ms at a time, as a serving loop
    waiting on its GPU would: (fn's seconds, longest gap between wake-ups in seconds). A gap
    well above 0.2 ms means fn held the GIL that long."""
    import threading

    out = {}

    def work():
        t0 = time.perf_counter()
        fn()
        out["seconds"] = time.perf_counter() - t0

    th = threading.Thread(target=work)
    gap, last = 0.0, time.perf_counter()
    th.start()
    while th.is_alive():
        time.sleep(0.0002)
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    th.join()
    return out["seconds"], gap


def part3(args):
    from eplb.formats import load_trace

    c = load_trace(SYNTH).counts_TLE.astype(float)
    T, L, E = c.shape
    G, R = 32, 32
    print(f"\n## Part 3: cost at DeepSeek-V3 shape ({L} layers x {E} experts, {G} GPUs, {E + R} slots; "
          f"synthetic windows of {os.path.relpath(SYNTH)})")
    start = plan(c[0], num_gpus=G, num_redundant=R).placement
    import scipy.optimize  # noqa: F401  (one-time import, ~1 s, not a per-decision cost)
    import scipy.sparse.csgraph  # noqa: F401

    rb = Rebalancer(start, window=8, interval=10**9, budget=mg.Budget(move_cost=0.001), policy=None)
    rng = np.random.default_rng(0)
    step_LE = rng.poisson(c[1] / 8).astype(float)
    phys = start.slot_loads(step_LE)
    t_log, t_phy = [], []
    for _ in range(200):
        t0 = time.perf_counter()
        rb.observe(step_LE)
        t_log.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        rb.observe(phys)
        t_phy.append(time.perf_counter() - t0)
    t_check, t_plan, t_dec, t_sched, t_total, moves = [], [], [], [], [], []
    t_py, stall_rb, stall_py = [], [], []
    for t in range(1, min(T, 1 + args.decisions)):
        rb = Rebalancer(start, window=8, interval=10**9, budget=mg.Budget(move_cost=0.001), policy=None)
        rb.observe(c[max(0, t - 3):t + 1].sum(axis=0))
        t0 = time.perf_counter()
        rb.predicted_improvement()
        t_check.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        res = rb.rebalance(apply=False)
        t_total.append(time.perf_counter() - t0)
        t_plan.append(res.info["seconds"])
        t_dec.append(res.info["decision_seconds"])
        t_sched.append(res.info["schedule_seconds"])
        moves.append(res.moves)
        # The same rebalance on a side thread, as a serving engine runs it: how long is the
        # serving (main) thread held up? And the Python reference schedule the same way.
        stall_rb.append(serving_stall(rb.rebalance)[1])
        old_LP, new_LP = start.phy2log_LP, res.placement.phy2log_LP
        sec, stall = serving_stall(lambda o=old_LP, n=new_LP: python_schedule(o, n, G, E))
        t_py.append(sec)
        stall_py.append(stall)
        start = res.placement
    ms = lambda x: f"{np.median(x) * 1e3:.2f}"  # noqa: E731
    print(format_table(["operation", "median ms", "max ms"], [
        ["observe(logical [L, E])", float(ms(t_log)), float(np.max(t_log) * 1e3)],
        ["observe(physical [L, P])", float(ms(t_phy)), float(np.max(t_phy) * 1e3)],
        ["decision check (current vs lower bound)", float(ms(t_check)), float(np.max(t_check) * 1e3)],
        ["migration step of plan (relabel + budgeted search)", float(ms(t_plan)), float(np.max(t_plan) * 1e3)],
        ["rebalance() decision (greedy + migration + metrics)", float(ms(t_dec)), float(np.max(t_dec) * 1e3)],
        ["rebalance() migration schedule (compiled)", float(ms(t_sched)), float(np.max(t_sched) * 1e3)],
        ["rebalance() total", float(ms(t_total)), float(np.max(t_total) * 1e3)],
        ["migration schedule, Python reference (tests/oracles)", float(ms(t_py)), float(np.max(t_py) * 1e3)],
        ["serving-thread stall while rebalance() runs aside", float(ms(stall_rb)), float(np.max(stall_rb) * 1e3)],
        ["serving-thread stall while the Python schedule runs", float(ms(stall_py)), float(np.max(stall_py) * 1e3)],
    ]))
    print(f"compiled / Python schedule time: {np.median(t_sched) / np.median(t_py):.3f} (medians); "
          f"stall = longest gap between the serving thread's 0.2 ms sleeps")
    print(f"{len(moves)} consecutive rebalances on drifting windows: moves median {np.median(moves):.0f}")


def part4(args):
    from eplb.stats.loads import group_span

    loads, source = v3_workloads(args.v3_dir)
    names = list(loads)
    G, N, K, R = 32, 4, 8, 32
    E = next(iter(loads.values())).shape[1]
    print(f"\n## Part 4: node-aware rebalancing (DeepSeek-V3, {G} GPUs on {N} nodes, {K} expert groups, "
          f"{E + R} slots)")
    print(f"source: {source}; serving: the hierarchical plan for A; reference: a from-scratch hierarchical "
          f"plan for B; budgeted plans use the greedy target (as the Rebalancer does by default)")
    hier = {n: plan(loads[n], num_gpus=G, num_nodes=N, num_redundant=R, planner="hierarchical",
                    num_expert_groups=K).placement
            for n in names}
    span = lambda phy: float(group_span(phy, Topology(G, phy.shape[1] // G, N), K, E).mean())  # noqa: E731
    pairs = [(a, b) for a in names for b in names if a != b]
    ref_span = np.median([span(hier[b].phy2log_LP) for _, b in pairs])
    rows = []
    for cost in args.span_costs:
        out = {"15": [], "c": []}
        for a, b in pairs:
            prev, load = hier[a], loads[b]
            ref = imbalance(load, hier[b].phy2log_LP, G)[0]
            budget = int(args.budget * mg.count_moves(prev.phy2log_LP, hier[b].phy2log_LP, G, E).sum())
            for key, kw in (("15", dict(max_moves=budget)), ("c", dict(move_cost=0.001))):
                t0 = time.perf_counter()
                res = plan(load, num_gpus=G, num_nodes=N, num_redundant=R, num_expert_groups=K, previous=prev,
                           budget=mg.Budget(span_cost=cost, **kw))
                dt = time.perf_counter() - t0
                phy = res.placement.phy2log_LP
                out[key].append((imbalance(load, phy, G)[0] / ref, span(phy), res.info["migration"]["moves"], dt))
        for key, label in (("15", f"{args.budget:.0%} budget"), ("c", "move_cost 0.001")):
            a = np.array(out[key])
            rows.append([label, cost, float(np.median(a[:, 0])), float(a[:, 0].max()), float(np.median(a[:, 1])),
                         float(np.median(a[:, 2])), float(np.median(a[:, 3]) * 1e3)])
    print(format_table(["budgeted plan for B", "span_cost", "busiest vs hierarchical (median)", "worst pair",
                        "group span", "moves", "decision ms"], rows))
    print(f"group span of the from-scratch hierarchical plans: median {ref_span:.2f} nodes (greedy: {N}.00); "
          f"medians over {len(pairs)} ordered pairs")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--v3-dir", default=os.path.join(SHARED, "deepseek_v3_sglang"))
    ap.add_argument("--v2-lite", default=os.path.join(SHARED, "deepseek_v2_lite_per_token", "per_token_topk.npz"))
    ap.add_argument("--budget", type=float, default=0.15, help="move budget as a share of the scratch replan's moves")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per window in part 2")
    ap.add_argument("--history", type=int, default=2, help="windows the planners look back on in part 2")
    ap.add_argument("--min-improvement", type=float, default=0.02)
    ap.add_argument("--move-cost", type=float, default=0.002)
    ap.add_argument("--decisions", type=int, default=10, help="rebalances timed in part 3")
    ap.add_argument("--span-costs", type=float, nargs="+", default=[0.0, 0.5, 1.0, 2.0, 4.0],
                    help="span_cost values compared in part 4")
    ap.add_argument("--parts", default="1234")
    add_write_docs(ap, "migration")
    args = ap.parse_args(argv)
    with results_page("migration", "Migration-aware planning, safe schedules, the Rebalancer", args.write_docs, argv):
        return run(args)


def run(args) -> int:
    print(f"eplb migration benchmark ({os.cpu_count()} CPUs; timings are wall-clock, single process)")
    # The kernels are compiled by numba (EPLB_JIT=wait: in this thread, at their first call, or
    # loaded from the cache). A serving process pays that once, so a first rebalance of a tiny
    # placement takes it here, apart from every timing below.
    t0 = time.perf_counter()
    warm = Rebalancer(Placement(np.arange(8).reshape(1, 8) % 6, 4, 6), interval=1)
    warm.observe(np.arange(1.0, 7.0)[None])
    warm.rebalance()
    print(f"numba kernels ready in {time.perf_counter() - t0:.1f} s (once per process; not in the timings below)")
    if "1" in args.parts:
        part1(args)
    if "2" in args.parts:
        part2(args)
    if "3" in args.parts:
        part3(args)
    if "4" in args.parts:
        part4(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
