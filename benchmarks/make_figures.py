"""Regenerate the README figures (PNG, small) from the shipped trace and, if present, real traces.

    python benchmarks/make_figures.py                      # -> benchmarks/figures/*.png
    python benchmarks/make_figures.py --real ../shared/traces --out benchmarks/figures

Shipped trace: traces/deepseek.npz (synthetic, eplb.synth); when it is missing a seeded
synthetic trace is generated (eplb.synth, or a log-normal fallback if that module is absent),
and the script says so. Real traces: SGLang DeepSeek-V3 expert statistics under
../shared/traces/deepseek_v3_sglang (never copied into the repo); figures made from them are
named real_*.png. Everything is seeded: the same inputs give the same figures.

Backtest figure: uses eplb.backtest when that module exists; otherwise a small replay here
(plan on the previous windows, score the next one) stands in, and the script says which.
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

from eplb import plot, stats  # noqa: E402
from eplb.placement import Placement  # noqa: E402
from eplb.planning import plan, planner_names  # noqa: E402
from eplb.topology import Topology  # noqa: E402
from eplb.trace import Trace, default_meta, load_trace  # noqa: E402
from planners.contiguous import contiguous_map  # noqa: E402

MAX_BYTES = 200_000


def shipped_trace(path: Path) -> tuple[Trace, str]:
    if path.exists():
        return load_trace(path), f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
    try:
        from eplb.synth import SynthSettings, generate

        return generate(SynthSettings(seed=0)), f"eplb.synth seed 0 ({path} not found)"
    except ImportError:
        rng = np.random.default_rng(0)
        counts = np.round(rng.lognormal(4.0, 0.9, size=(16, 58, 256))).astype(np.int64)
        meta = default_meta(61, 256, synthetic=True, source="make_figures log-normal fallback")
        return Trace(counts, np.arange(3, 61), meta), "seeded log-normal fallback (eplb.synth absent)"


def contiguous(trace: Trace, gpus: int, redundant: int | None = None) -> Placement:
    topo = Topology.for_experts(trace.num_experts, gpus=gpus, redundant=redundant)
    return Placement(contiguous_map(trace.num_experts, topo, trace.num_layers), gpus, trace.num_experts,
                     layer_ids=trace.layer_ids, planner="contiguous")


def replay(trace: Trace, gpus: int, every: int, history: int, planner: str = "greedy") -> plot.TimelineSeries:
    """Re-plan every `every` windows on the previous `history` windows; score each window as it comes.

    Window t is served by the plan made from windows before t (never from t itself), so the
    figure shows what a serving system would have seen. Moves: replicas copied onto a GPU
    that did not hold that expert (eplb.migration.count_moves after relabelling, if present).
    """
    counts = trace.counts_TLE.astype(np.float64)
    T = trace.num_windows
    current = None
    imb, at, moves = [], [], []
    for t in range(history, T):
        if current is None or (t - history) % every == 0:
            new = plan(counts[t - history:t], gpus=gpus, planner=planner).placement
            moves.append(_moves(current, new, gpus, trace.num_experts))
            at.append(t - history)
            current = new
        imb.append(float(stats.imbalance(current.gpu_loads(counts[t])).mean()))
    name = f"{planner}, re-planned every {every} windows" if every < T else f"{planner}, planned once"
    return plot.TimelineSeries(name, np.array(imb), np.array(at), np.array(moves, dtype=float))


def _moves(old: Placement | None, new: Placement, gpus: int, E: int) -> float:
    if old is None:
        return 0.0  # the first plan replaces the startup placement; not counted against the policy
    try:
        from eplb.migration import count_moves, relabel

        perm_LP = relabel(old.phy2log_LP, new.phy2log_LP, gpus, E)
        new_LP = np.take_along_axis(new.phy2log_LP, perm_LP, axis=1)
        return float(count_moves(old.phy2log_LP, new_LP, gpus, E).sum())
    except ImportError:
        return float((old.phy2log_LP != new.phy2log_LP).sum())


def backtest_series(trace: Trace, gpus: int) -> tuple[list, str]:
    try:
        import eplb.backtest as bt  # noqa: F401
        runner = getattr(bt, "run_backtest", None) or getattr(bt, "backtest", None)
    except ImportError:
        runner = None
    if runner is not None:
        try:
            return plot.as_timeline(runner(trace, gpus=gpus)), "eplb.backtest"
        except Exception as exc:  # a different signature: say so and use the local replay
            print(f"  eplb.backtest did not run with (trace, gpus=...): {exc}; using the local replay")
    history = 4
    T = trace.num_windows
    counts = trace.counts_TLE.astype(np.float64)
    base = contiguous(trace, gpus)
    series = [plot.TimelineSeries("contiguous (no EPLB)",
                                  np.array([stats.imbalance(base.gpu_loads(counts[t])).mean()
                                            for t in range(history, T)]))]
    series.append(replay(trace, gpus, every=T, history=history))
    series.append(replay(trace, gpus, every=8, history=history))
    series.append(replay(trace, gpus, every=2, history=history))
    return series, "local replay in make_figures.py (eplb.backtest absent)"


def write(fig, out: Path, name: str, made: list) -> None:
    path = out / name
    plot.save(fig, path)
    size = path.stat().st_size
    made.append((name, size))
    if size > MAX_BYTES:
        print(f"  warning: {name} is {size / 1024:.0f} KiB (> {MAX_BYTES // 1000} KB)")


def figures_for(trace: Trace, out: Path, prefix: str, gpus: int, planners: list[str], made: list,
                label: str, backtest: bool) -> None:
    load = trace.total().astype(np.float64)
    write(plot.expert_heatmap(trace, title=f"Expert load / layer mean, {label}"), out, f"{prefix}heatmap.png", made)
    results: dict = {"contiguous": contiguous(trace, gpus)}
    for name in planners:
        t0 = time.perf_counter()
        results[name] = plan(trace, gpus=gpus, planner=name)
        print(f"  {prefix or 'shipped '}{name}: {time.perf_counter() - t0:.2f} s, median busiest/mean "
              f"{np.median(results[name].after.imbalance_L):.4f}")
    write(plot.gpu_load_comparison(load, results, layer_ids=trace.layer_ids,
                                   title=f"Busiest / mean GPU per layer, {gpus} GPUs, one redundant slot per GPU; "
                                         f"{label}"), out, f"{prefix}balance.png", made)
    first = next(n for n in planners if n != "contiguous")
    write(plot.replica_map(results[first], load, title=f"{first} placement on {gpus} GPUs, {label}"),
          out, f"{prefix}replicas.png", made)
    if backtest and trace.num_windows >= 8:
        series, how = backtest_series(trace, gpus)
        print(f"  backtest: {how}")
        tpw = trace.meta.get("tokens_per_window")
        xl = f"window ({tpw:,} tokens each)" if tpw else "window"
        write(plot.backtest_timeline(series, window_label=xl,
                                     metric_label="busiest / mean GPU load,\nmean over layers",
                                     title=f"Backtest on {label}: each window served by a plan made from earlier "
                                           f"windows ({gpus} GPUs)"),
              out, f"{prefix}backtest.png", made)


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
    print(f"shipped trace: {source}: {trace.num_windows} windows x {trace.num_layers} layers x {trace.num_experts} experts")
    figures_for(trace, out, "", args.gpus, planners, made, "synthetic DeepSeek-V3 trace", backtest=True)
    real = Path(args.real) / "deepseek_v3_sglang" / f"{args.real_workload}.json"
    if real.exists():
        rt = load_trace(real)
        print(f"real trace: {real} ({rt.num_layers} layers x {rt.num_experts} experts)")
        figures_for(rt, out, "real_", args.gpus, planners, made, f"SGLang DeepSeek-V3 {args.real_workload}",
                    backtest=False)
    else:
        print(f"real traces not found at {real}: real_*.png not made")
    for name, size in made:
        print(f"{os.path.join(args.out, name)}  {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
