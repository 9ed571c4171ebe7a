"""Figures over time: a backtest's or a replay's balance per window, and when it rebalanced.

Legend: T = time windows, L = MoE layers, G = GPUs.

`TimelineSeries` is one planner's (or policy's) run; `timeline_from_backtest` and
`timeline_from_json` read them from backtest results or their JSON, `as_timeline` from any of
those; `backtest_timeline` draws series side by side, `replay_timeline` a replay's arrays.
Figures are built as in eplb.evaluate.plot: without pyplot, written when given `path`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eplb.errors import EplbError, is_number, is_whole, number_array, whole_array
from eplb.evaluate.backtest import BacktestResult
from eplb.evaluate.plot import BASELINE_COLOUR, PALETTE, _colours, _figure, _finish


@dataclass(frozen=True, eq=False)
class TimelineSeries:
    """One planner's run through a backtest: balance per window, and when it rebalanced."""

    name: str
    """Planner (or policy) name shown in the legend."""
    imbalance_T: np.ndarray
    """Busiest GPU / mean GPU load in each window (e.g. the median over layers), [T]."""
    rebalance_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Window indices at which a new placement took effect, [R] (sorted, in 0..T-1)."""
    moves: np.ndarray | None = None
    """Experts copied onto GPUs at each rebalance (summed over layers), [R]; NaN where not
    counted (the first plan of a backtest replaces whatever was served before)."""

    def __post_init__(self) -> None:
        imb = number_array(f"{self.name}: imbalance_T", self.imbalance_T).astype(np.float64)
        if imb.ndim != 1 or imb.size == 0:
            raise EplbError(f"{self.name}: imbalance_T must be a non-empty 1-D array, got shape {imb.shape}")
        if not np.all(np.isfinite(imb)):
            raise EplbError(f"{self.name}: imbalance_T holds NaN or infinite values")
        at = whole_array(f"{self.name}: rebalance_at (window indices)", self.rebalance_at).reshape(-1)
        if at.size and (at.min() < 0 or at.max() >= imb.size or np.any(np.diff(at) < 0)):
            raise EplbError(f"{self.name}: rebalance_at must be sorted window indices in 0..{imb.size - 1}, "
                            f"got {at.tolist()}")
        mv = None
        if self.moves is not None:
            raw = self.moves.tolist() if isinstance(self.moves, np.ndarray) else self.moves
            if not isinstance(raw, (list, tuple)) or not all(m is None or is_number(m) for m in raw):
                raise EplbError(f"{self.name}: moves must be a list of numbers (null = not counted), one per "
                                f"rebalance, got {str(raw)[:100]}")
            mv = np.array([np.nan if m is None else m for m in raw], dtype=np.float64)
            if mv.shape != at.shape:
                raise EplbError(f"{self.name}: {mv.size} move counts for {at.size} rebalances: give one per rebalance")
            if np.any(mv[~np.isnan(mv)] < 0) or np.any(np.isinf(mv)):
                raise EplbError(f"{self.name}: move counts must be finite and >= 0 (NaN/None = not counted), "
                                f"got {mv.tolist()}")
        object.__setattr__(self, "imbalance_T", imb)
        object.__setattr__(self, "rebalance_at", at)
        object.__setattr__(self, "moves", mv)


def timeline_from_backtest(results: Any, dispatch: str = "even") -> list[TimelineSeries]:
    """One series per backtest result: its per-window imbalance under one dispatch policy.

    results: `eplb.evaluate.backtest.BacktestResult` objects or their `summary()` dicts (one, or a
    list; also the `{"results": [...]}` object that `eplb backtest --json` prints). Each
    series is named after the planner (plus interval / history when one planner appears
    more than once); imbalance_T is the busiest / mean GPU (median over layers) of each
    scored window; rebalance_at is the position, among the scored windows, of the first
    window each plan serves; moves are the copies each rebalance cost (NaN for the first
    plan, which is not charged). All results must score the same windows (one x axis).
    """
    if isinstance(results, Mapping) and "results" in results:
        results = results["results"]
    if isinstance(results, (BacktestResult, Mapping)):
        results = [results]
    if not isinstance(results, Sequence) or isinstance(results, (str, bytes)) or not results:
        raise EplbError(f"expected backtest results (BacktestResult or its summary() dict, or a list of them), "
                        f"got {type(results).__name__ if results is not None else None}")
    summaries = [r.summary() if isinstance(r, BacktestResult) else _summary_dict(r, i) for i, r in enumerate(results)]
    windows = [[w.get("window") for w in s["per_window"]] for s in summaries]
    if any(w != windows[0] for w in windows):
        spans = ", ".join(f"{s['planner']}: {_span(w)}" for s, w in zip(summaries, windows))
        raise EplbError(f"backtest results score different windows ({spans}): plot results of one "
                        f"`eplb backtest` run (same traces and --history) together")
    names = _series_names(summaries)
    out = []
    for name, s in zip(names, summaries):
        imb, plan_W = [], []
        for w in s["per_window"]:
            scores = w["imbalance"]
            if dispatch not in scores:
                raise EplbError(f"backtest result {s['planner']!r} has no {dispatch!r} dispatch scores "
                                f"(it scored {', '.join(scores) or 'none'}): pick one of those as the dispatch "
                                f"policy (eplb plot backtest --dispatch)")
            imb.append(scores[dispatch])
            plan_W.append(w["plan"])
        if not all(is_whole(p) for p in plan_W):
            raise EplbError(f"backtest result {s['planner']!r}: per_window 'plan' entries must be plan indices "
                            f"(whole numbers), got {[p for p in plan_W if not is_whole(p)][:3]}")
        per_plan = s.get("per_plan", [])
        if not isinstance(per_plan, list) or not all(isinstance(p, Mapping) and is_whole(p.get("plan"))
                                                     for p in per_plan):
            raise EplbError(f"backtest result {s['planner']!r}: per_plan must be a list of objects with a 'plan' "
                            f"index, as `eplb backtest --json` writes")
        # A plan starts serving at the first scored window that names it.
        first: dict = {}
        for i, p in enumerate(plan_W):
            first.setdefault(int(p), i)
        moves_of = {int(p["plan"]): p.get("moves") for p in per_plan}
        moves = [moves_of.get(p) for p in first]
        out.append(TimelineSeries(name, imb, np.fromiter(first.values(), np.int64),
                                  moves if any(m is not None for m in moves) else None))
    return out


def _summary_dict(obj: Any, i: int) -> Mapping:
    if not isinstance(obj, Mapping):
        raise EplbError(f"backtest result {i} is a {type(obj).__name__}: expected a BacktestResult or its "
                        f"summary() dict")
    missing = [k for k in ("planner", "per_window") if k not in obj]
    if missing:
        raise EplbError(f"backtest result {i} lacks {', '.join(map(repr, missing))}: expected a summary from "
                        f"`eplb backtest --json` (keys planner, mode, interval, history, per_plan, per_window)")
    if not obj["per_window"]:
        raise EplbError(f"backtest result {i} ({obj['planner']!r}) has no scored windows")
    for w in obj["per_window"]:
        if not isinstance(w, Mapping) or "plan" not in w or not isinstance(w.get("imbalance"), Mapping):
            raise EplbError(f"backtest result {i} ({obj['planner']!r}): each per_window entry needs 'plan' and an "
                            f"'imbalance' object {{policy: value}}, got {w!r}")
    return obj


def _span(windows: list) -> str:
    return f"windows {windows[0]}..{windows[-1]}" if windows else "no windows"


def _series_names(summaries: list[Mapping]) -> list[str]:
    """Planner names, with interval (then history, then a number) added only where needed."""
    def interval(s: Mapping) -> str:
        if s.get("mode", "sequential") != "sequential":
            return str(s.get("mode"))
        n = s.get("interval")
        return f"every {n} window{'' if n == 1 else 's'}"

    def history(s: Mapping) -> str:
        return f"history {s.get('history') or 'all'}"

    names = [str(s["planner"]) for s in summaries]
    for describe in (interval, history):
        dup = {n for n in names if names.count(n) > 1}
        names = [f"{n}, {describe(s)}" if n in dup else n for n, s in zip(names, summaries)]
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if names.count(n) == 1 else f"{n} #{seen[n]}")
    return out


def timeline_from_json(data: Any, dispatch: str = "even", source: str = "backtest JSON") -> list[TimelineSeries]:
    """Series from parsed JSON: `eplb backtest --json` output ({"results": [summary, ...]}),
    or explicit series {"series": [{"name", "imbalance": [T], "rebalance_at": [R],
    "moves": [R]}, ...]} (rebalance_at and moves optional; a null move = not counted)."""
    if isinstance(data, Mapping) and isinstance(data.get("results"), list):
        return timeline_from_backtest(data["results"], dispatch)
    if isinstance(data, Mapping) and isinstance(data.get("series"), list) and data["series"]:
        out = []
        for i, item in enumerate(data["series"]):
            if not isinstance(item, Mapping) or "name" not in item or "imbalance" not in item:
                raise EplbError(f"{source}: series {i} needs 'name' and 'imbalance' (a list per window)")
            extra = set(item) - {"name", "imbalance", "rebalance_at", "moves"}
            if extra:
                raise EplbError(f"{source}: series {i} has unknown key(s) {sorted(extra)}: allowed are name, "
                                f"imbalance, rebalance_at, moves")
            try:
                out.append(TimelineSeries(str(item["name"]), item["imbalance"], item.get("rebalance_at", []),
                                          item.get("moves")))
            except EplbError as exc:
                raise EplbError(f"{source}: series {i}: {exc}") from None
        return out
    keys = sorted(data) if isinstance(data, Mapping) else type(data).__name__
    raise EplbError(f"{source}: expected the output of `eplb backtest --json` (an object with a 'results' list) "
                    f"or an object with a non-empty 'series' list; got {keys}")


def as_timeline(obj: Any) -> list[TimelineSeries]:
    """TimelineSeries from one or a list of them, a name -> [T] imbalance mapping, or
    `eplb.evaluate.backtest.BacktestResult`(s) (even dispatch; see `timeline_from_backtest` for others).
    Parsed JSON goes through `timeline_from_json`."""
    if isinstance(obj, TimelineSeries):
        return [obj]
    if isinstance(obj, BacktestResult):
        return timeline_from_backtest([obj])
    if isinstance(obj, Mapping):
        if any(k in obj for k in ("results", "series", "per_window")):
            raise EplbError("this is backtest JSON, not a name -> [windows] mapping: read it with "
                            "eplb.evaluate.timeline.timeline_from_json (or timeline_from_backtest)")
        if not obj:
            raise EplbError("no backtest series to plot")
        return [v if isinstance(v, TimelineSeries) else TimelineSeries(str(k), v) for k, v in obj.items()]
    if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)) and obj:
        if all(isinstance(x, TimelineSeries) for x in obj):
            return list(obj)
        if all(isinstance(x, BacktestResult) for x in obj):
            return timeline_from_backtest(list(obj))
    raise EplbError(f"cannot plot a backtest from {type(obj).__name__}: give TimelineSeries, a name -> [windows] "
                    f"mapping or BacktestResult(s)")


def backtest_timeline(series: Any, *, window_label: str = "window", title: str | None = None,
                      metric_label: str = "busiest GPU / mean GPU load", path=None):
    """Balance over time per planner, with rebalance points, and the moves each rebalance cost.

    series: TimelineSeries (see `as_timeline` for what else is accepted). Top: the imbalance
    of each window, rebalances marked with a triangle; bottom: expert moves per rebalance
    (rebalances whose moves were not counted get no bar).
    """
    runs = as_timeline(series)
    T = max(r.imbalance_T.size for r in runs)
    colours = _colours([r.name for r in runs])
    with_moves = [r for r in runs if r.moves is not None and np.isfinite(r.moves).any()]
    fig = _figure(11, 5.6 if with_moves else 4.2)
    if with_moves:
        top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2.2, 1))
    else:
        top, bottom = fig.subplots(1, 1), None
    for r in runs:
        t = np.arange(r.imbalance_T.size)
        moved = r.moves[np.isfinite(r.moves)] if r.moves is not None else np.zeros(0)
        extra = f", median {np.median(moved):,.0f} moves" if moved.size else ""
        top.plot(t, r.imbalance_T, lw=1.3, color=colours[r.name],
                 label=f"{r.name} (mean {r.imbalance_T.mean():.3f}, {r.rebalance_at.size} "
                       f"plan{'' if r.rebalance_at.size == 1 else 's'}{extra})")
        if r.rebalance_at.size:
            top.scatter(r.rebalance_at, r.imbalance_T[r.rebalance_at], marker="v", s=28, color=colours[r.name],
                        zorder=3, edgecolor="black", linewidth=0.4)
    top.axhline(1.0, color="black", lw=0.5)
    top.set_ylabel(metric_label + "\n(1 = perfect)")
    top.grid(alpha=0.3)
    top.legend(fontsize=8, loc="best")
    top.set_title(title or "Backtest: balance per window (triangles: a new placement takes effect)")
    if bottom is not None:
        width = 0.8 / len(with_moves)
        for i, r in enumerate(with_moves):
            ok = np.isfinite(r.moves)
            offset = (i - (len(with_moves) - 1) / 2) * width
            bottom.bar(r.rebalance_at[ok] + offset, r.moves[ok], width=width, color=colours[r.name], label=r.name)
        bottom.set_ylabel("experts copied\nper rebalance")
        bottom.grid(alpha=0.3, axis="y")
        bottom.set_xlabel(window_label)
    else:
        top.set_xlabel(window_label)
    (bottom or top).set_xlim(-0.5, T - 0.5)
    return _finish(fig, path)


def replay_timeline(arrays: Mapping[str, np.ndarray], meta: Mapping, *, rule: str | None = None,
                    title: str | None = None, path=None):
    """Busiest / mean GPU per served window of a replay, with the moments of rebalancing.

    arrays, meta: what `eplb.formats.replay.read_replay` returns. rule: the dispatch rule to
    draw (default the first scored). Top: the policy's median over layers per window (band:
    its p95 over layers), the static plan and hindsight as references, a triangle where a new
    placement took effect; bottom: experts copied by each decision.
    """
    rules = list(meta["rules"])
    rule = rules[0] if rule is None else rule
    if rule not in rules:
        raise EplbError(f"this replay scored the rules {', '.join(rules)}, not {rule!r}: pick one of those")
    i = rules.index(rule)
    x = arrays["window_T"]
    fig = _figure(11, 5.6)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2.2, 1))
    runs = [("policy", meta.get("policy_name", "policy")), ("static", "static plan"), ("hindsight", "hindsight")]
    colours = dict(zip([r for r, _ in runs], (PALETTE[0], BASELINE_COLOUR, PALETTE[2])))
    for key, label in runs:
        imb_TL = arrays.get(f"{key}_imbalance_RTL")
        if imb_TL is None:
            continue
        imb_TL = imb_TL[i]
        med = np.median(imb_TL, axis=1)
        top.plot(x, med, lw=1.4 if key == "policy" else 1.0, color=colours[key], ls="-" if key == "policy" else "--",
                 label=f"{label} (median {np.median(imb_TL):.3f}, p95 {np.percentile(imb_TL, 95):.3f})")
        if key == "policy":
            top.fill_between(x, med, np.percentile(imb_TL, 95, axis=1), color=colours[key], alpha=0.15, lw=0)
            at = arrays["applied_T"].astype(bool)
            top.scatter(x[at], med[at], marker="v", s=30, color=colours[key], edgecolor="black", linewidth=0.4,
                        zorder=3, label="new placement takes effect")
    top.axhline(1.0, color="black", lw=0.5)
    top.set_ylabel(f"busiest / mean GPU load\n(median over layers; {rule} dispatch)")
    top.grid(alpha=0.3)
    top.legend(fontsize=8, loc="best")
    top.set_title(title or f"Replay: {meta.get('policy_name', 'policy')} policy, {meta.get('num_gpus')} GPUs, "
                           f"{meta.get('num_slots')} slots (band: p95 over layers)")
    moved = arrays["decided_T"].astype(bool)
    bottom.bar(x[moved], arrays["moves_T"][moved], width=0.8, color=colours["policy"])
    bottom.set_ylabel("experts copied\nper decision")
    bottom.set_xlabel("window of the trace (served ones)")
    bottom.grid(alpha=0.3, axis="y")
    bottom.set_xlim(x[0] - 0.5, x[-1] + 0.5)
    return _finish(fig, path)
