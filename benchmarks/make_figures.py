"""Regenerate the README and docs/cli.md figures (PNG, small) from the shipped trace and, if present, real traces.

    python benchmarks/make_figures.py                      # -> benchmarks/figures/*.png
    python benchmarks/make_figures.py --real ../shared/traces --out benchmarks/figures

Shipped trace: traces/deepseek.npz (synthetic, eplb.stats.synth); when it is missing a seeded
synthetic trace is generated (eplb.stats.synth, or a log-normal fallback if that module is absent),
and the script says so. Real traces: SGLang DeepSeek-V3 expert statistics under
../shared/traces/deepseek_v3_sglang (never copied into the repo); figures made from them are
named real_*.png. Everything is seeded: the same inputs give the same figures.

Backtest figure: `eplb.evaluate.backtest.backtest` on the shipped trace, each plan made from the 8
windows before it and scored (even dispatch) on the windows it serves: contiguous (no EPLB),
greedy re-planned every 8 and every 2 windows, robust every 8; moves are experts copied per
rebalance after relabelling GPUs. The same figure from the CLI:
    eplb backtest traces/deepseek.npz --gpus 32 -p greedy --interval 2 --history 8 --no-oracle --json
and `eplb plot backtest` on that output.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eplb.core.placement import Placement, contiguous_map  # noqa: E402
from eplb.core.topology import Topology  # noqa: E402
from eplb.core.trace import Trace, default_meta  # noqa: E402
from eplb.evaluate import plot, timeline  # noqa: E402
from eplb.formats import load_trace  # noqa: E402
from eplb.planning.front_door import plan  # noqa: E402
from planners.api import planner_names  # noqa: E402

MAX_BYTES = 200_000


def shipped_trace(path: Path) -> tuple[Trace, str]:
    if path.exists():
        return load_trace(path), f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
    try:
        from eplb.stats.synth import SynthSettings, generate

        return generate(SynthSettings(seed=0)), f"eplb.stats.synth seed 0 ({path} not found)"
    except ImportError:
        rng = np.random.default_rng(0)
        counts = np.round(rng.lognormal(4.0, 0.9, size=(16, 58, 256))).astype(np.int64)
        meta = default_meta(61, 256, synthetic=True, source="make_figures log-normal fallback")
        return Trace(counts, np.arange(3, 61), meta), "seeded log-normal fallback (eplb.stats.synth absent)"


def contiguous(trace: Trace, num_gpus: int, num_redundant: int | None = None) -> Placement:
    topo = Topology.for_experts(trace.num_logical_experts, num_gpus=num_gpus, num_redundant=num_redundant)
    return Placement(contiguous_map(trace.num_logical_experts, topo, trace.num_layers), num_gpus,
                     trace.num_logical_experts, layer_ids=trace.layer_ids, planner="contiguous")


BACKTEST_HISTORY = 8
BACKTEST_RUNS = (
    ("contiguous (no EPLB)", "contiguous", None),
    ("greedy, re-planned every 8 windows", "greedy", 8),
    ("greedy, re-planned every 2 windows", "greedy", 2),
    ("robust, re-planned every 8 windows", "robust", 8),
)
"""(legend, planner, re-plan interval in windows; None = planned once) in the backtest figure."""


def backtest_series(trace: Trace, num_gpus: int) -> list:
    """The backtest figure's series: each window served by a plan made from earlier windows only."""
    from eplb.evaluate.backtest import backtest

    results = []
    for legend, planner, every in BACKTEST_RUNS:
        t0 = time.perf_counter()
        r = backtest(trace, num_gpus=num_gpus, planner=planner, interval=every or trace.num_windows,
                     history=BACKTEST_HISTORY, dispatch=("even",), oracle=False, quiet=True)
        moves = r.summary()["moves_median"]
        print(f"  backtest {legend:<36} {len(r.plans):2d} plans, busiest/mean mean {r.column('imbalance').mean():.4f}"
              f" median {np.median(r.column('imbalance')):.4f}, moves per rebalance median "
              f"{'n/a' if moves is None else f'{moves:,.0f}'} ({time.perf_counter() - t0:.1f} s)")
        results.append(r)
    return [timeline.TimelineSeries(legend, s.imbalance_T, s.rebalance_at, s.moves)
            for (legend, _, _), s in zip(BACKTEST_RUNS, timeline.timeline_from_backtest(results, dispatch="even"))]


def write(fig, out: Path, name: str, made: list) -> None:
    path = out / name
    plot.save(fig, path)
    size = path.stat().st_size
    made.append((name, size))
    if size > MAX_BYTES:
        print(f"  warning: {name} is {size / 1024:.0f} KiB (> {MAX_BYTES // 1000} KB)")


def figures_for(trace: Trace, out: Path, prefix: str, num_gpus: int, planners: list[str], made: list,
                label: str, backtest: bool) -> None:
    load = trace.total().astype(np.float64)
    write(plot.expert_heatmap(trace, title=f"Expert load / layer mean, {label}"), out, f"{prefix}heatmap.png", made)
    results: dict = {"contiguous": contiguous(trace, num_gpus)}
    for name in planners:
        t0 = time.perf_counter()
        results[name] = plan(trace, num_gpus=num_gpus, planner=name)
        print(f"  {prefix or 'shipped '}{name}: {time.perf_counter() - t0:.2f} s, median busiest/mean "
              f"{np.median(results[name].after.imbalance_L):.4f}")
    write(plot.gpu_load_comparison(load, results, layer_ids=trace.layer_ids,
                                   title=f"Busiest / mean GPU per layer, {num_gpus} GPUs, one redundant slot per GPU; "
                                         f"{label}"), out, f"{prefix}balance.png", made)
    first = next(n for n in planners if n != "contiguous")
    write(plot.replica_map(results[first], load, title=f"{first} placement on {num_gpus} GPUs, {label}"),
          out, f"{prefix}replicas.png", made)
    if backtest and trace.num_windows > BACKTEST_HISTORY + 2:
        series = backtest_series(trace, num_gpus)
        tpw = trace.meta.get("tokens_per_window")
        xl = (f"scored window (0 = trace window {BACKTEST_HISTORY}"
              + (f"; {tpw:,} tokens each)" if tpw else ")"))
        write(timeline.backtest_timeline(series, window_label=xl,
                                     metric_label="busiest / mean GPU load,\nmedian over layers (even dispatch)",
                                     title=f"Backtest on {label}: each window served by a plan made from the "
                                           f"{BACKTEST_HISTORY} windows before it ({num_gpus} GPUs)"),
              out, f"{prefix}backtest.png", made)
    elif backtest:
        print(f"  backtest figure not made: {trace.num_windows} windows, it needs more than {BACKTEST_HISTORY + 2}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(ROOT / "traces" / "deepseek.npz"), help="shipped trace")
    ap.add_argument("--real", default=str(ROOT.parent / "shared" / "traces"),
                    help="folder with deepseek_v3_sglang/*.json (skipped when absent)")
    ap.add_argument("--real-workload", default="decode_in1000out1000", help="SGLang workload for real_*.png")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "figures"))
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--planners", default="greedy,deepseek,hierarchical",
                    help="comma-separated planners to compare (those not registered are skipped)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    known = set(planner_names())
    planners = [p for p in args.planners.split(",") if p in known]
    skipped = [p for p in args.planners.split(",") if p not in known]
    if skipped:
        print(f"planners not registered, skipped: {', '.join(skipped)}")
    made: list = []
    trace, source = shipped_trace(Path(args.trace))
    print(f"shipped trace: {source}: {trace.num_windows} windows x {trace.num_layers} layers x "
          f"{trace.num_logical_experts} experts")
    figures_for(trace, out, "", args.gpus, planners, made, "synthetic DeepSeek-V3 trace", backtest=True)
    real = Path(args.real) / "deepseek_v3_sglang" / f"{args.real_workload}.json"
    if real.exists():
        rt = load_trace(real)
        print(f"real trace: {real} ({rt.num_layers} layers x {rt.num_logical_experts} experts)")
        figures_for(rt, out, "real_", args.gpus, planners, made, f"SGLang DeepSeek-V3 {args.real_workload}",
                    backtest=False)
    else:
        print(f"real traces not found at {real}: real_*.png not made")
    for name, size in made:
        print(f"{os.path.join(args.out, name)}  {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
