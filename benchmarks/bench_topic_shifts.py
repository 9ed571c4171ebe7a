"""Topic shifts of every shape: the adaptive default against each fixed window, over several seeds.

    python benchmarks/bench_topic_shifts.py                    # 5 shapes x seeds 1 2 3, and v2-topics
    python benchmarks/bench_topic_shifts.py --write-docs       # also write docs/results/topic_shifts.md
    python benchmarks/bench_topic_shifts.py --shapes gradual --seeds 4 5 --no-real

Legend: T = windows, L = MoE layers, E = logical experts.

Traces (8 GPUs, 72 slots, as bench_replay's topic trace):
- synthetic: `eplb synth` with 6 topic shifts in 48 windows of 2,048 tokens (64 experts, top-2,
  26 layers, skew 1.0, one phase: bench_replay's TOPIC settings), in each shape of
  eplb.stats.topic_shifts.SHIFT_SHAPES (abrupt, gradual, recurring, inside, local), for every
  seed given (not one seed the policy could be tuned to);
- v2-topics (real, held out: never used to choose the policy's settings): DeepSeek-V2-Lite's
  per-token routing from ../shared (read there, never copied), its 1,999 prompts grouped into 3
  topics by k-means on each prompt's expert shares (token-weighted, seed 0), served in blocks
  of one topic of about 16,384 tokens each, topics taking turns (prompts of a topic in numeric
  order), cut into windows of >= 2,048 tokens. The routing is real; the order that makes the
  shifts is this script's.
Each trace is replayed with eplb.evaluate.replay.replay: the first half history (the robust plan
of it serves first), the second half served, one window of delay, so every score is on a window
no plan saw, only the past known. Scores: busiest / mean GPU over every (served window, layer)
under the engine's dispatch rule: the even split (vLLM, SGLang dynamic) and the per-batch
re-split of the window's own counts (exact at 8 GPUs; SGLang's `lp`), median and p95; moves:
experts copied per served window as a share of the L x P slots. Policies: window N (greedy on
the newest N windows at every decision, the Rebalancer's window=N), static, and the adaptive
default.
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
os.environ.setdefault("EPLB_JIT", "wait")  # machine code at first call: the replays are timed

from _report import add_write_docs, results_page  # noqa: E402  (benchmarks/_report.py)

from eplb.commands.common import format_table  # noqa: E402
from eplb.core.topology import Topology  # noqa: E402
from eplb.evaluate.replay import replay  # noqa: E402
from eplb.stats.synth import SynthSettings, generate  # noqa: E402
from eplb.stats.topic_shifts import SHIFT_SHAPES  # noqa: E402

TOPIC = dict(num_windows=48, tokens_per_window=2048, num_hidden_layers=27, first_moe_layer=1, num_experts=64,
             top_k=2, num_expert_groups=1, topk_groups=1, topic_shifts=6, skew=1.0, phase_share=0.0)
"""bench_replay's topic trace settings (its seed aside)."""
FIXED = [("window 2", {"window": 2}), ("window 8", {"window": 8}), ("window all", {"window": None})]
RUNS = [*((label, "window", st) for label, st in FIXED), ("static", "static", {}), ("adaptive", "adaptive", {})]
KEYS = (("even", "median"), ("even", "p95"), ("resplit", "median"), ("resplit", "p95"))


def v2_topics(path: Path, topics: int = 3, block_tokens: int = 16384, window_tokens: int = 2048,
              seed: int = 0) -> tuple[np.ndarray, str]:
    """Counts [T, 26, 64] of V2-Lite's prompts grouped by topic and served in blocks (see above)."""
    with np.load(path, allow_pickle=False) as z:
        keys = sorted(z.files, key=lambda k: int(re.sub(r"\D", "", k) or 0))
        prompts = [z[k].astype(np.int64) for k in keys]
    L, E = prompts[0].shape[0], 64
    count_NLE = np.stack([np.stack([np.bincount(a[l].ravel(), minlength=E) for l in range(L)]) for a in prompts])
    tokens_N = np.array([a.shape[1] for a in prompts], dtype=np.float64)
    x_NF = (count_NLE / np.maximum(count_NLE.sum(axis=2, keepdims=True), 1)).reshape(len(prompts), -1)
    # Step 1: k-means on the prompts' expert shares, weighted by their tokens.
    rng = np.random.default_rng(seed)
    c_KF = x_NF[rng.choice(len(x_NF), topics, replace=False, p=tokens_N / tokens_N.sum())]
    for _ in range(50):
        topic_N = ((x_NF[:, None] - c_KF[None]) ** 2).sum(axis=2).argmin(axis=1)
        c_KF = np.stack([np.average(x_NF[topic_N == k], axis=0, weights=tokens_N[topic_N == k])
                         for k in range(topics)])
    # Step 2: blocks of one topic, the topics taking turns, then windows of >= window_tokens.
    queues = [list(np.flatnonzero(topic_N == k)) for k in range(topics)]
    order, k = [], 0
    while any(queues):
        n = 0
        while queues[k] and n < block_tokens:
            i = queues[k].pop(0)
            order.append(i)
            n += tokens_N[i]
        k = (k + 1) % topics
    windows, cur, n = [], np.zeros((L, E), dtype=np.int64), 0
    for i in order:
        cur, n = cur + count_NLE[i], n + tokens_N[i]
        if n >= window_tokens:
            windows.append(cur)
            cur, n = np.zeros((L, E), dtype=np.int64), 0
    share = [int(tokens_N[topic_N == k].sum()) for k in range(topics)]
    return np.stack(windows), (f"{path.name}: {len(prompts)} prompts in {topics} k-means topics ({share} tokens), "
                               f"blocks of ~{block_tokens:,} tokens taking turns, {len(windows)} windows of "
                               f">= {window_tokens:,} tokens")


def run(counts_TLE: np.ndarray, topo: Topology) -> dict:
    """{policy: {(rule, stat): value, "moves": share of slots per window}} for one trace."""
    out = {}
    for label, policy, settings in RUNS:
        s = replay(counts_TLE, topology=topo, policy=policy, settings=settings, references=()).summary()
        out[label] = {**{(r, q): s["policy"][r][q] for r, q in KEYS}, "moves": s["moves_per_window_share_of_slots"]}
    return out


def cells(r: dict) -> list[str]:
    return [f"{r[('even', 'median')]:.3f} ({r[('even', 'p95')]:.3f})",
            f"{r[('resplit', 'median')]:.3f} ({r[('resplit', 'p95')]:.3f})", f"{100 * r['moves']:.1f}%"]


def table(rows: dict) -> str:
    head = ["trace", "policy", "even median (p95)", "re-split median (p95)", "moves / window"]
    return format_table(head, [[trace, label, *cells(r)] for trace, by in rows.items() for label, r in by.items()])


def verdict(name: str, by: dict) -> str:
    """Does adaptive beat every fixed window on each score (lower is better)?"""
    ad = by["adaptive"]
    parts = []
    for key in KEYS:
        best_label = min((lb for lb, _ in FIXED), key=lambda lb: by[lb][key])
        best = by[best_label][key]
        parts.append(f"{key[0]} {key[1]} {ad[key]:.3f} vs {best_label} {best:.3f} "
                     f"({100 * (ad[key] / best - 1):+.1f}%{'' if ad[key] < best else ', NOT below'})")
    return f"{name}: " + "; ".join(parts)


def mean_over(runs: list[dict]) -> dict:
    return {label: {k: float(np.mean([r[label][k] for r in runs])) for k in runs[0][label]} for label in runs[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHIFT_SHAPES), choices=list(SHIFT_SHAPES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--shared", type=Path, default=ROOT.parent / "shared" / "traces",
                    help="folder with the real traces (default ../shared/traces)")
    ap.add_argument("--no-real", dest="real", action="store_false", help="skip the held-out v2-topics trace")
    add_write_docs(ap, "topic_shifts")
    args = ap.parse_args(argv)
    with results_page("topic_shifts", "Topic shifts of every shape (benchmarks/bench_topic_shifts.py)",
                      args.write_docs, argv):
        return report(args)


def report(args) -> int:
    t0 = time.perf_counter()
    topo = Topology(8, 9)
    verdicts = []
    for shape in args.shapes:
        rows = {}
        for seed in args.seeds:
            trace = generate(SynthSettings(**TOPIC, seed=seed, **SHIFT_SHAPES[shape]))
            rows[f"{shape} seed {seed}"] = run(trace.counts_TLE, topo)
        rows[f"{shape} mean"] = mean_over(list(rows.values()))
        print(f"\n## {shape}: {SHIFT_SHAPES[shape] or 'whole-window shifts, one topic per window'}; "
              f"seeds {', '.join(map(str, args.seeds))}, and their mean")
        print(table(rows), flush=True)
        verdicts.append(verdict(f"{shape} (mean of {len(args.seeds)} seeds)", rows[f"{shape} mean"]))
    v2 = args.shared / "deepseek_v2_lite_per_token" / "per_token_topk.npz"
    if args.real and v2.is_file():
        counts, how = v2_topics(v2)
        by = run(counts, topo)
        print(f"\n## v2-topics (real routing, held out): {how}")
        print(table({"v2-topics": by}), flush=True)
        verdicts.append(verdict("v2-topics", by))
    elif args.real:
        print(f"\n# v2-topics left out: {v2} not found")
    print("\n## Adaptive against the best fixed window for each score (lower is better)")
    for line in verdicts:
        print(f"- {line}")
    print(f"\nbenchmark wall time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
