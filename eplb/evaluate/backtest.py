"""Backtests: plan on the past only, score on windows the planner has not seen.

Legend: T = windows, L = MoE layers, E = logical experts, G = GPUs, P = physical slots,
D = dispatch policies, W = scored windows, R = rebalance points (plans made).

In-sample scores (a plan judged on the load it was made from) say how good the optimiser
is; serving is judged on the *next* traffic. A backtest replays windows in order: at each
rebalance point it plans on the last `history` windows before it, then scores the next
`interval` windows. `leave_one_out` does the same over workloads: plan on all other trace
files (their windows as history), score on the one left out.

Scores, per dispatch policy (how an expert's tokens are split among its replicas):
- even:    1 / replicas, what most engines do;
- plan:    static weights fitted to the planning load (the plan's own weights if it has
           them, else `eplb.dispatch.optimal_weights` on the aggregated history);
- resplit: `eplb.dispatch.resplit` per window on the window's own counts (the fast rule a
           serving engine can run per batch);
- optimal: `eplb.dispatch.optimal_weights` per window on its own counts (the "oracle"
           re-split: the best any dispatch can do with this placement);
- time:    with a time objective only, the per-batch time dispatch
           (`eplb.dispatch.timed.TimeDispatch`), scored on the window's step batches.
With `objective=` an `eplb.dispatch.cost.TimeObjective`, every plan balances modeled time and each
scored window is also cut into step batches of the objective's batch tokens (seeded draws
from the window's counts: independent expert choices) and scored in modeled MoE seconds per
step under each policy (`step_seconds`; optimal, an LP per batch, is not).
For a window and policy: imbalance = busiest GPU / mean GPU (median over layers; `sum`
variants weigh layers by load: sum over layers of busiest / sum of mean, i.e. 1 /
balancedness); bound ratio = busiest GPU / lower bound of that window (no placement or split
beats the bound); forecast gap = busiest GPU / busiest GPU of an oracle plan made by the same
planner on that very window, with the same policy, minus 1 (the cost of not knowing the
future). The optimisation gap of a plan is its busiest GPU on its own planning load / lower
bound of that load, minus 1 (the cost of the optimiser, median over layers).

Moves (sequential mode): what each rebalance after the first costs, as experts copied onto a
GPU that did not hold them in that layer, summed over layers, after renaming the new plan's
GPUs to keep the most replicas of the plan it replaces (`eplb.migration.relabel`, then
`count_moves`). GPUs are interchangeable, so an engine applying the plan would rename them
too; counting without the renaming would charge a planner for an arbitrary GPU numbering.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eplb import stats
from eplb.core.placement import Placement
from eplb.core.progress import progress
from eplb.core.topology import Topology
from eplb.dispatch.cost import TimeObjective, check_objective
from eplb.dispatch.rules import Resplitter, optimal_weights
from eplb.dispatch.timed import TimeDispatch
from eplb.errors import EplbError, is_whole, seed_value, whole_number
from eplb.evaluate.simulate import check_batches, time_window, window_batches
from eplb.migration import count_moves, relabel
from eplb.planning.front_door import as_history, size_topology
from eplb.planning.front_door import plan as make_plan
from eplb.stats.loads import Aggregation

DISPATCH = ("even", "plan", "resplit", "optimal")
"""Dispatch policies a backtest scores by default (see the module docstring); "time" joins
them with a time objective."""


def _check_dispatch(dispatch: Sequence[str] | None, objective) -> tuple[str, ...]:
    timed = objective != "tokens"
    if dispatch is None:
        return DISPATCH + (("time",) if timed else ())
    dispatch = tuple(dispatch)
    known = DISPATCH + ("time",)
    bad = [d for d in dispatch if d not in known]
    if bad or not dispatch:
        raise EplbError(f"unknown dispatch polic(ies) {bad or dispatch!r}: choose from {', '.join(known)}")
    if "time" in dispatch and not timed:
        raise EplbError("dispatch 'time' splits step batches for modeled time: give objective=TimeObjective(...) "
                        "(CLI: --objective time --model M --hardware H)")
    return dispatch


@dataclass(frozen=True, eq=False)
class WindowScores:
    """Scores of one plan on one held-out window, one entry per dispatch policy."""

    window: int
    """Index of the scored window in the replayed sequence (or the held-out workload)."""
    plan_index: int
    """Which plan (rebalance point or fold) was served."""
    imbalance_D: np.ndarray
    """Busiest / mean GPU, median over layers, [D]."""
    imbalance_sum_D: np.ndarray
    """Sum over layers of busiest GPU / sum of mean GPU (1 / balancedness), [D]."""
    bound_ratio_D: np.ndarray
    """Busiest GPU / lower bound of the window, median over layers, [D]."""
    forecast_gap_D: np.ndarray
    """Busiest GPU vs an oracle plan made on this window (same planner and policy), minus 1,
    median over layers, [D]; NaN when oracle plans were not made."""
    step_seconds_D: np.ndarray | None = None
    """Modeled MoE seconds per step (mean over the window's batches), [D], with a time
    objective (NaN for optimal); None without one."""

    def __post_init__(self) -> None:
        shapes = {a.shape for a in (self.imbalance_D, self.imbalance_sum_D, self.bound_ratio_D, self.forecast_gap_D)}
        assert len(shapes) == 1, f"per-policy arrays disagree in shape: {shapes}"


@dataclass(frozen=True, eq=False)
class PlanScores:
    """One plan made during a backtest: what it saw and how it scored on its own load."""

    index: int
    history: tuple[int, int]
    """Windows [start, stop) it was planned on (for leave-one-out: the held-out index twice)."""
    seconds: float
    """Planner wall time."""
    status: str
    """The planner's status (HEURISTIC, OPTIMAL, FEASIBLE, FALLBACK)."""
    optimisation_gap_D: np.ndarray
    """Busiest GPU on the planning load / its lower bound, minus 1, median over layers, [D]."""
    moves: int | None = None
    """Experts copied onto GPUs that did not hold them, summed over layers, to go from the
    previous plan to this one (after relabelling GPUs); None for the first plan of a
    sequential backtest (it replaces whatever was served before) and in leave-one-out."""

    @property
    def serves_from(self) -> int:
        """First window this plan serves (sequential: the window after its history;
        leave-one-out: the held-out workload's index)."""
        return self.history[1]


@dataclass(frozen=True, eq=False)
class BacktestResult:
    """Everything a backtest measured, per dispatch policy; `summary()` gives medians."""

    planner: str
    mode: str
    """"sequential" (rebalance every `interval` windows) or "leave-one-out"."""
    num_gpus: int
    num_slots: int
    interval: int
    """Windows served by each plan (sequential mode; 1 for leave-one-out)."""
    history: int | None
    """Windows each plan looks back on (None = all past windows / all other workloads)."""
    dispatch: tuple[str, ...]
    """Scored dispatch policies, in the order of every [D] array."""
    plans: tuple[PlanScores, ...]
    windows: tuple[WindowScores, ...]
    labels: tuple[str, ...] = ()
    """Names of the scored windows (leave-one-out: the held-out trace files)."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """What was done differently from the defaults (e.g. plan weights from the LP)."""
    time: dict | None = None
    """What plans balanced and windows were scored in, with a time objective (model, hardware,
    phase, batch tokens); None for tokens."""

    @property
    def timed(self) -> bool:
        return self.time is not None

    def __post_init__(self) -> None:
        if not self.windows:
            raise EplbError("a backtest needs at least one scored window")
        D = len(self.dispatch)
        assert all(w.imbalance_D.shape == (D,) for w in self.windows)
        assert all(p.optimisation_gap_D.shape == (D,) for p in self.plans)

    def column(self, name: str) -> np.ndarray:
        """A per-window score stacked over windows, [W, D] (name: imbalance, imbalance_sum,
        bound_ratio, forecast_gap, step_seconds with a time objective)."""
        return np.stack([getattr(w, f"{name}_D") for w in self.windows])

    def summary(self) -> dict[str, Any]:
        """Medians over scored windows (and plans), per dispatch policy; JSON-ready."""
        def med(a_WD: np.ndarray) -> dict[str, float | None]:
            out = {}
            for d, col in zip(self.dispatch, a_WD.T):
                ok = col[np.isfinite(col)]
                out[d] = float(np.median(ok)) if ok.size else None
            return out

        gap = np.stack([p.optimisation_gap_D for p in self.plans])
        moved = [p.moves for p in self.plans if p.moves is not None]
        return {
            "planner": self.planner,
            "mode": self.mode,
            "gpus": self.num_gpus,
            "num_slots": self.num_slots,
            "interval": self.interval,
            "history": self.history,
            "plans": len(self.plans),
            "scored_windows": len(self.windows),
            "plan_seconds_median": float(np.median([p.seconds for p in self.plans])),
            "statuses": sorted({p.status for p in self.plans}),
            "moves_median": float(np.median(moved)) if moved else None,
            "time": self.time,
            "median": {
                "imbalance": med(self.column("imbalance")),
                "imbalance_sum": med(self.column("imbalance_sum")),
                "bound_ratio": med(self.column("bound_ratio")),
                "forecast_gap": med(self.column("forecast_gap")),
                "optimisation_gap": med(gap),
                **({"step_seconds": med(self.column("step_seconds"))} if self.timed else {}),
            },
            "per_plan": [
                {"plan": p.index, "history": list(p.history), "rebalance_window": p.serves_from,
                 "moves": p.moves, "seconds": p.seconds, "status": p.status}
                for p in self.plans
            ],
            "per_window": [
                {"window": w.window, "label": self.labels[i] if i < len(self.labels) else None,
                 "plan": w.plan_index, "imbalance": dict(zip(self.dispatch, w.imbalance_D.tolist())),
                 # NaN (no oracle plans) is not JSON: null instead.
                 "forecast_gap": {d: (v if np.isfinite(v) else None)
                                  for d, v in zip(self.dispatch, w.forecast_gap_D.tolist())}}
                for i, w in enumerate(self.windows)
            ],
            "notes": list(self.notes),
        }


class _Scorer:
    """Loads per GPU of one placement under every dispatch policy (tables built once)."""

    def __init__(self, placement: Placement, planning_load_LE: np.ndarray, dispatch: tuple[str, ...],
                 objective="tokens"):
        self.placement = placement
        self.dispatch = dispatch
        self.objective = objective
        self.even_LP = 1.0 / np.take_along_axis(placement.replica_count_LE, placement.phy2log_LP, axis=1)
        self.plan_LP = None
        self.resplitter = None
        if "plan" in dispatch:
            if placement.dispatch_weights_LP is not None:
                self.plan_LP = placement.dispatch_weights_LP
            else:
                self.plan_LP = optimal_weights(placement, planning_load_LE)
        if "resplit" in dispatch:
            self.resplitter = Resplitter(placement)
        self.timer = TimeDispatch(objective.cost).bind(placement) if "time" in dispatch else None

    def _shares(self, d: str, load_LE: np.ndarray) -> np.ndarray:
        if d == "even":
            return self.even_LP
        if d == "plan":
            return self.plan_LP
        if d == "resplit":
            return self.resplitter(load_LE)
        if d == "time":
            return self.timer(load_LE)
        return optimal_weights(self.placement, load_LE)

    def peaks(self, load_LE: np.ndarray, batches: list | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Busiest GPU per layer under each policy, [D, L], and with step batches the modeled
        seconds per step under each policy, [D] (NaN for optimal). The time dispatch's token
        loads are those it gave over the batches (it splits batches, not windows)."""
        out, sec = [], []
        for d in self.dispatch:
            w = None if (d == "time" and batches) else self._shares(d, load_LE)
            if batches:
                if d == "optimal":
                    sec.append(np.nan)
                else:
                    rule = (lambda c, d=d: self._shares(d, c)) if d != "time" else self.timer
                    layer_L, batch_w = time_window(self.objective.cost, self.placement, rule, batches)
                    sec.append(float(layer_L.sum()))
                    w = batch_w if w is None else w
            out.append(self.placement.gpu_loads(load_LE, w).max(axis=1))
        return np.stack(out), (np.array(sec) if batches else None)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den with idle (zero) layers counted as perfect (1)."""
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)


class _Runner:
    """Shared machinery of both backtest modes: plan, score, oracle plans."""

    def __init__(self, planner: str, topology: Topology, *, dispatch: Sequence[str] | None, settings: dict | None,
                 num_expert_groups: int | None, aggregate: str | Aggregation, oracle: bool, objective="tokens",
                 batches_per_window: int = 8, seed: int = 0):
        self.planner = planner
        self.topology = topology
        self.objective = check_objective(objective)
        self.kw = dict(topology=topology, planner=planner, settings=settings, num_expert_groups=num_expert_groups,
                       objective=self.objective)
        self.dispatch = _check_dispatch(dispatch, self.objective)
        self.aggregate = aggregate
        self.oracle = oracle
        self.batches_per_window = whole_number("batches per window", batches_per_window, 1)
        self.seed = seed_value("seed", seed)
        self.notes: list[str] = []
        self.time = None
        if self.objective != "tokens":
            model = self.objective.cost.model  # one window's batches at a time
            check_batches(1, self.batches_per_window, model.num_moe_layers, model.num_logical_experts)
            B = self.objective.tokens_for(topology.num_gpus)
            self.time = {**self.objective.describe(topology.num_gpus), "batches_per_window": self.batches_per_window,
                         "how": f"{self.batches_per_window} batches of {B:,} tokens drawn per window from its counts "
                                f"(seed {seed}): independent expert choices assumed"}
            if "optimal" in self.dispatch:
                self.notes.append("optimal: not scored in modeled time (an LP per step batch)")

    def batches(self, load_LE: np.ndarray, window: int) -> list | None:
        """The window's step batches for modeled time (None for tokens)."""
        if self.objective == "tokens":
            return None
        model = self.objective.cost.model
        rng = np.random.default_rng([self.seed, window])
        return window_batches(load_LE, model.top_k, self.objective.tokens_for(self.topology.num_gpus),
                              self.batches_per_window, rng, window)

    def make(self, history_TLE: np.ndarray, index: int, span: tuple[int, int], previous: Placement | None = None):
        """Plan on the history; with `previous` (the placement being served) count the moves."""
        result = make_plan(history_TLE, aggregate=self.aggregate, **self.kw)
        placement = result.placement
        scorer = _Scorer(placement, result.load_LE, self.dispatch, self.objective)
        lb_L = result.lower_bound_L
        gap_D = np.median(_ratio(scorer.peaks(result.load_LE)[0], lb_L[None]) - 1.0, axis=1)
        if "plan" in self.dispatch and placement.dispatch_weights_LP is None and index == 0:
            self.notes.append("plan weights: the planner gives none, so 'plan' uses the LP weights "
                              "(optimal_weights) fitted to each plan's aggregated history")
        if result.status == "FALLBACK":
            self.notes.append(f"plan {index}: planner fell back ({result.message})")
        moves = None if previous is None else _moves(previous, placement, self.topology.num_nodes)
        return scorer, PlanScores(index, span, result.seconds, result.status, gap_D, moves)

    def score(self, scorer: _Scorer, load_LE: np.ndarray, window: int, plan_index: int) -> WindowScores:
        G = scorer.placement.num_gpus
        batches = self.batches(load_LE, window)
        peak_DL, step_D = scorer.peaks(load_LE, batches)
        mean_L = load_LE.sum(axis=1) / G
        lb_L = stats.lower_bound(load_LE, G, scorer.placement.num_slots)
        imb_D = np.median(_ratio(peak_DL, mean_L[None]), axis=1)
        imb_sum_D = _ratio(peak_DL.sum(axis=1), mean_L.sum())  # an idle window is balanced (1), not 0
        bound_D = np.median(_ratio(peak_DL, lb_L[None]), axis=1)
        if self.oracle:
            oracle = make_plan(load_LE, **self.kw)
            oracle_DL = _Scorer(oracle.placement, load_LE, self.dispatch, self.objective).peaks(load_LE, batches)[0]
            fgap_D = np.median(_ratio(peak_DL, oracle_DL) - 1.0, axis=1)
        else:
            fgap_D = np.full(len(self.dispatch), np.nan)
        return WindowScores(window, plan_index, imb_D, imb_sum_D, bound_D, fgap_D, step_D)


def backtest(
    counts_TLE,
    *,
    topology: Topology | None = None,
    num_gpus: int | None = None,
    num_nodes: int = 1,
    num_redundant: int | None = None,
    slots_per_gpu: int | None = None,
    planner: str = "greedy",
    interval: int = 1,
    history: int | None = None,
    dispatch: Sequence[str] | None = None,
    settings: dict | None = None,
    num_expert_groups: int | None = None,
    aggregate: str | Aggregation = "sum",
    oracle: bool = True,
    quiet: bool = False,
    objective: str | TimeObjective = "tokens",
    batches_per_window: int = 8,
) -> BacktestResult:
    """Replay windows in order: every `interval` windows, plan on the last `history` windows
    (all past ones if None) and score the next `interval` windows.

    counts_TLE: a Trace or counts [T, L, E] with T >= 2 (the first rebalance point needs at
    least one past window: it is at window `history`, or 1 when history is None).
    Where: `topology`, or the sizes num_gpus, num_nodes, num_redundant / slots_per_gpu (as `eplb.plan`).
    dispatch: policies scored (default DISPATCH, and "time" with a time objective); objective:
    "tokens" or an eplb.dispatch.cost.TimeObjective (plans balance modeled time; windows are also scored
    in modeled seconds per step over `batches_per_window` drawn step batches).
    """
    c_TLE, _, meta = as_history(counts_TLE)
    topo = size_topology(c_TLE.shape[2], topology, num_gpus=num_gpus, num_nodes=num_nodes,
                         num_redundant=num_redundant, slots_per_gpu=slots_per_gpu)
    if num_expert_groups is None and meta.get("num_expert_groups"):
        num_expert_groups = int(meta["num_expert_groups"])
    T = c_TLE.shape[0]
    # Whole numbers only: int(2.5) would plan on 2 windows and report history 2 as asked.
    if not is_whole(interval) or int(interval) < 1:
        raise EplbError(f"interval must be a whole number of windows >= 1, got {interval!r}")
    interval = int(interval)
    if history is not None and (not is_whole(history) or int(history) < 1):
        raise EplbError(f"history must be a whole number of windows >= 1 (or None for all past windows), "
                        f"got {history!r}")
    start = 1 if history is None else int(history)
    if T <= start:
        raise EplbError(
            f"a backtest needs more windows than its history: {T} window(s), history "
            f"{'all past (at least 1)' if history is None else history} "
            f"(use a trace with more windows, a shorter --history, or --leave-one-out over several files)"
        )
    run = _Runner(planner, topo, dispatch=dispatch, settings=settings, num_expert_groups=num_expert_groups,
                  aggregate=aggregate, oracle=oracle, objective=objective, batches_per_window=batches_per_window)
    points = list(range(start, T, interval))
    plans, windows = [], []
    served = None
    for i, r in enumerate(progress(points, desc=f"backtest {planner}", enabled=False if quiet else None)):
        lo = 0 if history is None else r - int(history)
        scorer, ps = run.make(c_TLE[lo:r], i, (lo, r), served)
        served = scorer.placement
        plans.append(ps)
        for t in range(r, min(r + interval, T)):
            windows.append(run.score(scorer, c_TLE[t], t, i))
    return BacktestResult(planner, "sequential", topo.num_gpus, topo.num_slots, interval,
                          None if history is None else int(history), run.dispatch, tuple(plans),
                          tuple(windows), tuple(f"window {w.window}" for w in windows), tuple(run.notes),
                          run.time)


def leave_one_out(
    workloads: Sequence,
    *,
    topology: Topology | None = None,
    num_gpus: int | None = None,
    num_nodes: int = 1,
    num_redundant: int | None = None,
    slots_per_gpu: int | None = None,
    planner: str = "greedy",
    labels: Sequence[str] | None = None,
    dispatch: Sequence[str] | None = None,
    settings: dict | None = None,
    num_expert_groups: int | None = None,
    aggregate: str | Aggregation = "sum",
    oracle: bool = True,
    quiet: bool = False,
    objective: str | TimeObjective = "tokens",
    batches_per_window: int = 8,
) -> BacktestResult:
    """Plan on all workloads but one (their windows stacked as history), score on each window
    of the one left out; once per workload.

    workloads: Traces or counts [T, L, E] (or [L, E]) of one model, at least two.
    Where: `topology`, or the sizes num_gpus, num_nodes, num_redundant / slots_per_gpu (as `eplb.plan`).
    dispatch, objective, batches_per_window: as `backtest`.
    """
    loads = [as_history(w) for w in workloads]
    if len(loads) < 2:
        raise EplbError(f"leave-one-out needs at least 2 workloads (trace files), got {len(loads)}")
    shapes = {a.shape[1:] for a, _, _ in loads}
    if len(shapes) != 1:
        raise EplbError(f"workloads disagree in [layers, experts]: {sorted(shapes)}")
    if num_expert_groups is None:
        groups = {m.get("num_expert_groups") for _, _, m in loads} - {None}
        num_expert_groups = int(groups.pop()) if len(groups) == 1 else None
    labels = tuple(labels) if labels is not None else tuple(f"workload {i}" for i in range(len(loads)))
    if len(labels) != len(loads):
        raise EplbError(f"{len(labels)} labels for {len(loads)} workloads")
    topo = size_topology(loads[0][0].shape[2], topology, num_gpus=num_gpus, num_nodes=num_nodes,
                         num_redundant=num_redundant, slots_per_gpu=slots_per_gpu)
    run = _Runner(planner, topo, dispatch=dispatch, settings=settings, num_expert_groups=num_expert_groups,
                  aggregate=aggregate, oracle=oracle, objective=objective, batches_per_window=batches_per_window)
    plans, windows, window_labels = [], [], []
    for i in progress(range(len(loads)), desc=f"leave-one-out {planner}", enabled=False if quiet else None):
        history_TLE = np.concatenate([a for j, (a, _, _) in enumerate(loads) if j != i])
        scorer, ps = run.make(history_TLE, i, (i, i))
        plans.append(ps)
        held = loads[i][0]
        for t in range(held.shape[0]):
            windows.append(run.score(scorer, held[t], i, i))
            window_labels.append(labels[i] if held.shape[0] == 1 else f"{labels[i]}[{t}]")
    return BacktestResult(planner, "leave-one-out", topo.num_gpus, topo.num_slots, 1, None, run.dispatch,
                          tuple(plans), tuple(windows), tuple(window_labels), tuple(run.notes), run.time)


def _moves(old: Placement, new: Placement, num_nodes: int) -> int:
    """Experts copied onto GPUs that lacked them, old -> new, after the best GPU renaming."""
    G, E = new.num_gpus, new.num_logical_experts
    perm_LP = relabel(old.phy2log_LP, new.phy2log_LP, G, E, num_nodes=num_nodes)
    new_LP = np.take_along_axis(new.phy2log_LP, perm_LP, axis=1)
    return int(count_moves(old.phy2log_LP, new_LP, G, E).sum())
