"""Planning for per-batch re-split (SGLang's `lp` dispatch, eplb's `resplit`) at deployment scale.

    python benchmarks/bench_resplit_scale.py                  # real data from ../shared when present
    python benchmarks/bench_resplit_scale.py --write-docs     # also write docs/results/resplit_scale.md
    python benchmarks/bench_resplit_scale.py --traces v3 --no-decision

Legend: T = windows, L = MoE layers, E = logical experts, G = GPUs, P = physical slots.

Each trace is replayed as benchmarks/bench_replay.py does (first half history, second half served,
delay 1) with the adaptive policy twice, side by side in one run: planned for the even split (the
reference, `plan_for="even"`) and planned for re-split (`plan_for="resplit"`: the warm-up plan and
every decision searched under re-split scores, eplb.planning.resplit_repair). Every served window
is scored by the exact re-split optimum of the placement that served it
(eplb.dispatch.resplit_score.resplit_imbalance: water-filling bounds swept until they meet within
1e-6), busiest / mean GPU over (served window, layer): what an engine that solves the LP per batch
serves. Policies know only the windows before the one served.

Decision time at 144 and 256 GPUs: one `AdaptivePolicy(rule="resplit")` decision (16 windows of
memory) on synthetic DeepSeek-V3-shaped windows (58 x 256, gamma(0.7) popularity, 4,096 tokens x 8
each, seed 0), from the robust plan of those windows: 144 GPUs x 2 slots (288) and 256 GPUs x 2
slots (512).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("EPLB_JIT", "wait")

from _report import write_results  # noqa: E402
from bench_replay import load_traces  # noqa: E402

from eplb.commands.common import format_table  # noqa: E402
from eplb.core.topology import Topology  # noqa: E402
from eplb.dispatch.resplit_score import resplit_imbalance  # noqa: E402
from eplb.evaluate.replay import replay  # noqa: E402

TARGETS = {"v3": (1.015, 1.06, 120.0), "v2": (1.008, 1.11, 30.0)}
"""Trace -> (re-split median, p95, replay seconds) targets of issue 36."""


def exact_scores(r) -> np.ndarray:
    """Exact re-split busiest / mean GPU of every served (window, layer), [T x L]."""
    G = r.topology.num_gpus
    out = [resplit_imbalance(r.phy2log_TLP[t], r.counts_TLE[t][None].astype(np.float64), G)[0]
           for t in range(len(r.window_T))]
    return np.concatenate(out)


def run_trace(counts: np.ndarray, topo: Topology) -> dict:
    rows = {}
    for plan_for in ("even", "resplit"):
        t0 = time.perf_counter()
        r = replay(counts, topology=topo, policy="adaptive", references=(), plan_for=plan_for)
        sec = time.perf_counter() - t0
        x = exact_scores(r)
        rows[plan_for] = {"median": float(np.median(x)), "p95": float(np.percentile(x, 95)), "seconds": sec,
                          "policy_seconds": r.policy_seconds, "moves": int(r.moves_T.sum())}
    return rows


def decision_time(G: int, S: int, seed: int = 0) -> tuple[float, float, int]:
    """Seconds of one re-split decision at G GPUs x S slots (module docstring), and the gain."""
    from eplb.core.placement import Placement
    from eplb.planning.front_door import plan
    from eplb.serving.policy import AdaptivePolicy

    rng = np.random.default_rng(seed)
    L, E = 58, 256
    p = rng.gamma(0.7, 1.0, (L, E))
    p /= p.sum(axis=1, keepdims=True)
    win = np.stack([np.stack([rng.multinomial(4096 * 8, q) for q in p]) for _ in range(16)]).astype(np.float64)
    topo = Topology(G, S)
    start = Placement(plan(win, topology=topo, planner="robust").solution.phy2log_LP, G, E)
    pol = AdaptivePolicy(rule="resplit")
    for w in win:
        pol.observe(w, start)
    t0 = time.perf_counter()
    d = pol.decide(start)
    sec = time.perf_counter() - t0
    return sec, 0.0 if d is None else float(d.gain_L.sum()), 0 if d is None else int(d.changed_L.sum())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", type=Path, default=ROOT.parent / "shared" / "traces")
    ap.add_argument("--traces", nargs="+", default=["v3", "v2", "deepseek", "topic"],
                    choices=["v2", "v3", "deepseek", "topic"])
    ap.add_argument("--no-decision", dest="decision", action="store_false", help="skip the 144 / 256-GPU decisions")
    ap.add_argument("--write-docs", action="store_true", help="write docs/results/resplit_scale.md")
    args = ap.parse_args(argv)
    text: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        text.append(line)

    say(f"# cores: {os.cpu_count()} (shared with other jobs: seconds are upper bounds); scores: exact re-split "
        f"busiest / mean GPU over every (served window, layer), adaptive policy, first half history")
    body, lines = [], []
    for name, counts, topo, how in load_traces(args.shared, args.traces):
        say(f"- {name}: {how}; {topo.num_gpus} GPUs, {topo.num_slots} slots")
        rows = run_trace(counts, topo)
        for plan_for, r in rows.items():
            body.append([name, plan_for, f"{r['median']:.4f}", f"{r['p95']:.4f}", f"{r['seconds']:.1f}",
                         f"{r['policy_seconds']:.1f}", f"{r['moves']:,}"])
        e, s = rows["even"], rows["resplit"]
        worse = 100 * (s["median"] / e["median"] - 1)
        line = f"{name}: planned for re-split vs for even: median {worse:+.2f}% (target <= +0.5%)"
        if name in TARGETS:
            m, p, sec = TARGETS[name]
            line += (f"; median {s['median']:.4f} (<= {m}), p95 {s['p95']:.4f} (<= {p}), replay {s['seconds']:.0f} s "
                     f"(<= {sec:.0f} s)")
        lines.append(line)
        print(line, flush=True)
    say("```\n" + format_table(["trace", "planned for", "re-split median", "p95", "replay s", "policy s", "moves"],
                               body) + "\n```")
    say("\n## Targets (issue 36)")
    for line in lines:
        say(f"- {line}")
    if args.decision:
        say("\n## One re-split decision at scale (synthetic DeepSeek-V3 shape, 16 windows of memory)")
        rows = []
        for G, S in ((144, 2), (256, 2)):
            sec, gain, layers = decision_time(G, S)
            rows.append([f"{G} GPUs x {S} slots ({G * S})", f"{sec:.2f}", str(layers), f"{gain:.3f}"])
            print(rows[-1], flush=True)
        say("```\n" + format_table(["shape", "decision s", "layers changed", "gain (sum over layers)"], rows) + "\n```")
        say("target: 256 GPUs / 512 slots, one decision <= 2 s")
    if args.write_docs:
        head = ("# Planning for per-batch re-split at scale (benchmarks/bench_resplit_scale.py)\n\n"
                "Written by `python benchmarks/bench_resplit_scale.py --write-docs`. See docs/dispatch.md for the "
                "re-split rule and docs/replay.md for the policy.\n\n")
        print(f"wrote {write_results('resplit_scale', head + chr(10).join(text) + chr(10))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
