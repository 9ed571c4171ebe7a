"""Drive the Rebalancer from a simulated serving loop and print what it did.

Run (from the repository root):

    python examples/serving_loop.py                       # traces/deepseek.npz, 32 GPUs
    python examples/serving_loop.py --trace my.npz --gpus 16 --steps-per-window 8 --fail-rank 5
    python examples/serving_loop.py --nodes 4             # node-aware: hierarchical start, span_cost
    python examples/serving_loop.py --policy none         # the older rule: a threshold, then a fresh plan

Legend: T = trace windows, L = MoE layers, E = logical experts, P = physical slots.

Each trace window is replayed as `--steps-per-window` serving steps (the window's counts
split at random over the steps). Every step, the engine reports its per-slot token counts
(physical [L, P], what an engine's dispatcher sees) to `Rebalancer.observe`. Every
`--interval` observations close a window for the Rebalancer's online policy (the default,
`adaptive`: it repairs the placement where the gain pays for the moves, or keeps it); the
decision runs on a side thread, as a server would, while the loop keeps serving and
observing; the placement switches when it is ready. Optionally a rank fails halfway. With
--nodes > 1 the server starts from a node-aware (hierarchical) plan and the Rebalancer is told
the expert groups, so its changes keep groups on few nodes (span_cost).
Without the trace file, seeded random loads of DeepSeek-V3 shape are used.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from eplb import Budget, plan  # noqa: E402
from eplb.serving.rebalance import Rebalancer  # noqa: E402

BYTES_PER_EXPERT = 3 * 7168 * 2048  # DeepSeek-V3 expert: 3 matrices 7168 x 2048 at 1 byte (FP8)


def load_windows(path: str, seed: int) -> tuple[np.ndarray, str, int | None]:
    """(counts [T, L, E], source, expert groups) from an eplb trace, or seeded random drifting
    loads (8 groups, as DeepSeek-V3) if it is absent."""
    if os.path.exists(path):
        from eplb.formats import load_trace

        trace = load_trace(path)
        return trace.counts_TLE.astype(np.float64), path, trace.meta.get("num_expert_groups")
    rng = np.random.default_rng(seed)
    T, L, E = 32, 58, 256
    base = rng.gamma(0.6, 1.0, (L, E))
    out = np.empty((T, L, E))
    for t in range(T):
        base = 0.9 * base + 0.1 * rng.gamma(0.6, 1.0, (L, E))      # slow drift of the hot set
        out[t] = rng.poisson(base / base.sum(axis=1, keepdims=True) * 16384)
    return out, f"seeded random loads (seed {seed}; {path} not found)", 8


def finish(worker: threading.Thread, pending: dict, step: int) -> None:
    """Wait for the side thread's rebalance and print it (the placement is already switched)."""
    worker.join()
    res = pending.pop("result")
    s = res.migration.summary()
    wall = pending.pop("wall")
    if res.moves == 0:
        print(f"step {step:5d}: kept the placement (decided in {wall * 1e3:.0f} ms): {res.message}")
        return None
    print(f"step {step:5d}: rebalanced (planned in {wall * 1e3:.0f} ms on the side thread): "
          f"busiest/mean GPU {np.median(res.before.imbalance_L):.3f} -> {np.median(res.after.imbalance_L):.3f} "
          f"(median layer), {s['moves']} copies in {s['rounds']} rounds "
          f"({s['bytes'] / 2**30:.1f} GiB, {s['staging_copies']} staging)"
          + (f"; groups span {res.info['group_span_before']:.2f} -> {res.info['group_span_after']:.2f} nodes"
             if "group_span_after" in res.info else ""))
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=os.path.join(ROOT, "traces", "deepseek.npz"))
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (> 1: node-aware)")
    ap.add_argument("--span-cost", type=float, default=1.0,
                    help="with --nodes > 1: moves a group's spread onto one more node costs (0: node-blind)")
    ap.add_argument("--redundant", type=int, default=32)
    ap.add_argument("--steps-per-window", type=int, default=10)
    ap.add_argument("--interval", type=int, default=40, help="observations per policy window (or between checks)")
    ap.add_argument("--policy", default="adaptive", choices=["adaptive", "window", "none"],
                    help="the Rebalancer's online policy (none: the min-improvement rule)")
    ap.add_argument("--min-improvement", type=float, default=0.03, help="with --policy none: the threshold")
    ap.add_argument("--max-moves", type=int, default=600, help="copies per rebalance")
    ap.add_argument("--fail-rank", type=int, default=None, help="this rank fails halfway through")
    ap.add_argument("--step-ms", type=float, default=20.0,
                    help="simulated forward time per step (sleeps; the side thread plans meanwhile)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    counts_TLE, source, groups = load_windows(args.trace, args.seed)
    T, L, E = counts_TLE.shape
    rng = np.random.default_rng(args.seed)
    # The server starts with a plan made on the first window only (stale soon after).
    start = plan(counts_TLE[0], num_gpus=args.gpus, num_nodes=args.nodes, num_redundant=args.redundant,
                 num_expert_groups=groups, planner="hierarchical" if args.nodes > 1 else "greedy").placement
    policy = None if args.policy == "none" else args.policy
    budget = Budget(max_moves=args.max_moves, move_cost=0.001 if policy is None else 0.0, span_cost=args.span_cost,
                    bytes_per_expert=BYTES_PER_EXPERT)
    rule = dict(min_improvement=args.min_improvement) if policy is None else {}
    rb = Rebalancer(start, window=4 * args.steps_per_window, interval=args.interval, budget=budget,
                    num_expert_groups=groups, policy=policy, **rule)
    where = os.path.relpath(source) if os.path.exists(source) else source
    print(f"trace: {where}: {T} windows x {L} layers x {E} experts; {args.gpus} GPUs on {args.nodes} node(s), "
          f"{start.num_slots} slots, {groups} expert groups; {args.steps_per_window} steps per window")
    how = (f"policy {args.policy}, a window every {args.interval} steps" if policy else
           f"check every {args.interval} steps, rebalance if predicted gain >= {args.min_improvement:.0%}")
    print(f"rebalancer: {how}, <= {args.max_moves} copies each; failed ranks plan on the sliding window of "
          f"{4 * args.steps_per_window} steps")

    pending: dict = {}
    worker: threading.Thread | None = None
    observe_s = []
    served_max = served_mean = 0.0

    def plan_in_background(failed=()):
        t0 = time.perf_counter()
        pending["result"] = rb.rebalance(failed_ranks=failed)
        pending["wall"] = time.perf_counter() - t0

    step = 0
    for t in range(T):
        # Split the window's counts over its steps (Poisson around random shares).
        share = rng.dirichlet(np.ones(args.steps_per_window))
        steps = np.stack([rng.poisson(counts_TLE[t] * s) for s in share]).astype(np.float64)
        for c_LE in steps:
            pl = rb.placement
            slot_LP = pl.slot_loads(c_LE)                 # what each physical slot served this step
            g = pl.gpu_loads(c_LE)                        # what each GPU served
            served_max += g.max(axis=1).sum()
            served_mean += g.mean(axis=1).sum()
            t0 = time.perf_counter()
            due = rb.observe(slot_LP)
            observe_s.append(time.perf_counter() - t0)
            step += 1
            time.sleep(args.step_ms / 1e3)           # the model's forward pass would run here
            if due and worker is None:
                chk = rb.last_check
                print(f"step {step:5d}: " + (f"check says rebalance (predicted gain {chk['predicted_improvement']:.1%})"
                                             if policy is None else chk["reason"]))
                worker = threading.Thread(target=plan_in_background)
                worker.start()
            if worker is not None and not worker.is_alive():
                worker = finish(worker, pending, step)
        if args.fail_rank is not None and t == T // 2:
            if worker is not None:
                worker = finish(worker, pending, step)
            res = rb.rebalance(failed_ranks=[args.fail_rank])
            s = res.migration.summary()
            print(f"step {step:5d}: rank {args.fail_rank} failed: re-planned on {res.placement.num_gpus} ranks, "
                  f"{len(res.lost_experts)} (layer, expert) pairs reloaded from checkpoint, {s['moves']} copies "
                  f"in {s['rounds']} rounds; busiest/mean GPU {np.median(res.after.imbalance_L):.3f}")
    if worker is not None:
        worker = finish(worker, pending, step)
    obs = np.asarray(observe_s) * 1e6
    print(f"served {step} steps: balancedness (mean GPU / busiest GPU, all layers) {served_mean / served_max:.3f}")
    print(f"observe(): median {np.median(obs):.0f} us, p99 {np.percentile(obs, 99):.0f} us "
          f"(checks included; planning runs on the side thread)")
    return 0


if __name__ == "__main__":
    from eplb.errors import EplbError

    try:
        sys.exit(main())
    except EplbError as exc:                     # bad options: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
