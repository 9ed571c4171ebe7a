"""greedy's packing: longest-processing-time (the kernel's `pack`) against plain rounds, after refine.

    python benchmarks/bench_pack.py [--layers 300] [--seed 7] [--repeats 5] [--write-docs]

`pack` runs S rounds of G while they agree with LPT with a slot limit and LPT from the first
replica where they part (planners/_pack_kernel.py); the rounds alone are `_rounds` without
its guard, what `pack` was before. Both are followed by greedy's refine until no swap helps, on
the same replica counts. The loads are seeded synthetic Pareto layers (floor(pareto(a) x 1000)
+ 1, a smaller a is more skewed) at 7 shapes; generated here, no data is read. Columns: the
busiest GPU after refine, LPT / rounds (the mean over layers, and the share of layers worse or
better), the swaps refine made in all layers, and the time of pack + refine (medians, one
thread, the two interleaved; the rounds compiled here as `pack` is).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from numba import njit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _report import add_write_docs, results_page  # noqa: E402

from planners import _greedy_kernel as kernel  # noqa: E402
from planners import _pack_kernel as packing  # noqa: E402

SHAPES = [(32, 5, 128), (64, 7, 384), (16, 4, 60), (8, 3, 20), (32, 9, 256), (128, 3, 256), (4, 2, 6)]
"""(GPUs, slots per GPU, experts): Qwen3-235B's 128 experts on 32 GPUs, Kimi-K2's 384 on 64,
DeepSeek-V3's 256 on 32 and 128, and small ones."""

SKEWS = [0.8, 1.2, 2.0, 5.0]


@njit(nogil=True)
def rounds_only(per_LE, count_LE, order_LE, G, S):
    """phy2log [L, P] packed in plain rounds (the kernel's `_rounds` without its LPT guard),
    compiled like `pack` so that the times compare."""
    L, E = per_LE.shape
    P = G * S
    phy = np.empty((L, P), dtype=np.int64)
    rep = np.empty(P, dtype=np.int64)
    gl, gl0 = np.empty(G), np.empty(G)
    gorder, chosen, last = np.empty(G, dtype=np.int64), np.empty(G, dtype=np.int64), np.empty(E, dtype=np.int64)
    order = np.empty(E, dtype=np.int64)
    for r in range(L):
        packing._replicas(per_LE[r], count_LE[r], order_LE[r], order, rep)
        packing._rounds(per_LE[r], rep, G, S, phy[r], gl, gl0, gorder, chosen, last, False)
    return phy


def busiest(phy_LP, per_LE, G, S):
    return np.take_along_axis(per_LE, phy_LP, axis=1).reshape(len(phy_LP), G, S).sum(axis=2).max(axis=1)


def run(args) -> int:
    rng = np.random.default_rng(args.seed)
    print(f"{args.layers} layers per row; refine until no swap helps (at most 4 x P swaps a layer)\n")
    print("| GPUs | slots/GPU | experts | skew a | busiest LPT / rounds (mean) | worse % | better % "
          "| swaps rounds | swaps LPT | ms rounds | ms LPT | time LPT / rounds |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for G, S, E in SHAPES:
        P = G * S
        for a in SKEWS:
            load_LE = np.floor(rng.pareto(a, (args.layers, E)) * 1000) + 1
            count_LE = kernel.replicate(load_LE, P, G)
            per_LE = load_LE / count_LE
            order_LE = np.argsort(-per_LE, axis=1)

            case = (per_LE, count_LE, order_LE, G, S)

            def with_rounds(case=case):
                phy = rounds_only(*case)
                return phy, kernel.refine(phy, case[0], case[3], 4 * case[3] * case[4], True, 0.0)

            def with_lpt(case=case):
                phy = kernel.pack(*case)
                return phy, kernel.refine(phy, case[0], case[3], 4 * case[3] * case[4], True, 0.0)

            times = {with_rounds: [], with_lpt: []}
            out = {}
            for _ in range(args.repeats):
                for fn in times:
                    t0 = time.perf_counter()
                    out[fn] = fn()
                    times[fn].append(time.perf_counter() - t0)
            (phy_r, swaps_r), (phy_l, swaps_l) = out[with_rounds], out[with_lpt]
            ratio = busiest(phy_l, per_LE, G, S) / busiest(phy_r, per_LE, G, S)
            t_r, t_l = (float(np.median(times[fn])) for fn in (with_rounds, with_lpt))
            print(f"| {G} | {S} | {E} | {a} | {ratio.mean():.6f} | {100 * (ratio > 1 + 1e-12).mean():.1f} "
                  f"| {100 * (ratio < 1 - 1e-12).mean():.1f} | {swaps_r} | {swaps_l} | {t_r * 1e3:.2f} "
                  f"| {t_l * 1e3:.2f} | {t_l / t_r:.2f} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=300)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=5)
    add_write_docs(ap, "pack")
    args = ap.parse_args()
    one = (np.ones((1, 2)), np.ones((1, 2), dtype=np.int64), np.zeros((1, 2), dtype=np.int64), 2, 1)
    kernel.refine(kernel.pack(*one), np.ones((1, 2)), 2, 4, True, 0.0)  # load (and compile) before timing
    rounds_only(*one)
    with results_page("pack", "greedy's packing: LPT vs rounds", args.write_docs, sys.argv[1:]):
        return run(args)


if __name__ == "__main__":
    sys.exit(main())
