"""Planning front door: `plan()` and its PlanResult.

Legend: T = windows, L = MoE layers, E = logical experts, G = GPUs, P = physical slots.

Planners live in the top-level `planners/` package, one module per algorithm, behind the
planner table of `planners.api`. `plan()` is the one front door: it normalises input,
sizes the topology, runs the planner, times it and adapts the plan to the placement now
served. Scores (the contiguous baseline, the lower bound, the plan's own report) are computed
on first access of the PlanResult, so a serving loop that adopts the placement and throws the
report away does not pay for them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any

import numpy as np

from eplb import migration, stats
from eplb.core.files import MAX_INPUT_ENV, format_size, max_input_bytes
from eplb.core.placement import Placement, check_same_layers, contiguous_placement
from eplb.core.topology import Topology
from eplb.core.trace import MAX_COUNT, Trace
from eplb.dispatch.cost import TimeObjective, check_objective
from eplb.dispatch.rules import DispatchRule, EvenSplit, PlanWeights, get_rule
from eplb.errors import EplbError, number_array, whole_number
from eplb.migration import Budget, layout_dependent
from eplb.planning.resplit_plan import re_splits, search_solution
from eplb.planning.resplit_repair import PLAN_ROUNDS
from eplb.stats.loads import Aggregation
from planners.api import STATUSES, PlanRequest, Solution, get_planner


@dataclass(frozen=True, eq=False)
class PlanResult:
    """A plan plus how it was made; how good it is is scored on first access (and cached).

    Scores use the planning load `load_LE` and the dispatch rule the engine will apply; under
    an engine's rule (anything but "plan", eplb's own runtime) `served` names that report and
    `planned` is the plan under its own weights, the split the planner assumed."""

    solution: Solution
    """The planner's answer after the migration step: phy2log_LP, dispatch weights, status, message, info."""
    planner: str
    seconds: float
    """Wall time of the planner alone."""
    load_LE: np.ndarray
    """The load the plan was made on and is scored on, [L, E]."""
    topology: Topology
    dispatch: DispatchRule = field(default_factory=PlanWeights)
    """The rule `after` and `before` are scored under (eplb.dispatch)."""
    layer_ids: np.ndarray | None = None
    """Hidden-layer index of each MoE layer [L] (None: 0..L-1)."""
    objective: str | TimeObjective = "tokens"
    """What the planner balanced: "tokens", or modeled time (an eplb.dispatch.cost.TimeObjective); the
    scores are in tokens either way."""

    def __post_init__(self) -> None:
        # Built now, not on first access: a planner's bad output fails in plan(), where it was made.
        sol, topo = self.solution, self.topology
        object.__setattr__(self, "_plain", Placement(
            sol.phy2log_LP, topo.num_gpus, self.load_LE.shape[1], topo.num_nodes, self.layer_ids,
            sol.dispatch_weights_LP, self.planner))

    @property
    def status(self) -> str:
        return self.solution.status

    @property
    def success(self) -> bool:
        return self.solution.status != "FALLBACK"

    @property
    def message(self) -> str:
        return self.solution.message

    @property
    def info(self) -> dict:
        return dict(self.solution.info)

    @cached_property
    def lower_bound_L(self) -> np.ndarray:
        """Lower bound on the busiest GPU's load per layer, [L] (`stats.lower_bound`)."""
        return lower_bound(self.load_LE, self.topology, self._plain.replica_count_LE)  # type: ignore[attr-defined]

    def _score(self, placement: Placement, rule: DispatchRule | None = None) -> stats.LoadReport:
        return score(placement, self.load_LE, rule or self.dispatch, self.lower_bound_L)

    @cached_property
    def after(self) -> stats.LoadReport:
        """The plan, scored on the planning load under the dispatch rule."""
        return self._score(self._plain)  # type: ignore[attr-defined]

    @property
    def served(self) -> stats.LoadReport | None:
        """The plan as an engine serves it (`after`, under the engine's rule `dispatch`), or None
        when the rule is "plan": eplb's runtime serves the plan's own weights, and `after` is that."""
        return None if isinstance(self.dispatch, PlanWeights) else self.after

    @cached_property
    def planned(self) -> stats.LoadReport:
        """The plan under its own dispatch weights (an even split without them): the split the
        planner assumed, which an engine's rule may not apply (compare with `served`)."""
        if isinstance(self.dispatch, PlanWeights):
            return self.after
        return self._score(self._plain, PlanWeights())  # type: ignore[attr-defined]

    @cached_property
    def before(self) -> stats.LoadReport:
        """The contiguous placement (no EPLB) on the same GPUs, scored the same way."""
        plain: Placement = self._plain  # type: ignore[attr-defined]
        return self._score(_contiguous(plain.num_logical_experts, self.topology, tuple(plain.layer_ids.tolist())))

    @cached_property
    def placement(self) -> Placement:
        """The plan, with its scores in `metrics` (what `eplb plan -o` writes)."""
        after = self.after
        metrics = {
            **after.metrics(),
            "contiguous_imbalance_median": stats.median(self.before.imbalance_L),
            **self.objective_metrics,
        }
        if self.served is not None:  # the scores above are the engine's: say under which rule
            metrics["dispatch"] = self.dispatch.name
        return self._plain.with_metrics(metrics)  # type: ignore[attr-defined]

    @property
    def objective_metrics(self) -> dict[str, str]:
        """{"objective": "time"} for a plan made for modeled time (`eplb simulate` then serves it
        with the time dispatch by default), else nothing."""
        return {} if self.objective == "tokens" else {"objective": self.objective.name}

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary (what `eplb plan --json` prints)."""
        p = self.placement
        return {
            "planner": self.planner,
            "status": self.status,
            "success": self.success,
            "message": self.message,
            "seconds": self.seconds,
            "num_layers": p.num_layers,
            "num_logical_experts": p.num_logical_experts,
            "num_gpus": p.num_gpus,
            "num_nodes": p.num_nodes,
            "num_slots": p.num_slots,
            "dispatch": self.dispatch.name,
            "before": self.before.summary(),
            "after": self.after.summary(),
            "served": None if self.served is None else self.served.summary(),
            "planned": self.planned.summary(),
            "info": self.info,
        }


def lower_bound(load_LE: np.ndarray, topology: Topology, count_LE: np.ndarray | None = None) -> np.ndarray:
    """`stats.lower_bound(load_LE, G, P)`, [L]. count_LE: a plan's replica counts [L, E] (sum P
    per layer); the layers where `stats.proven_bound` proves them min-max optimal take their
    largest load per replica as the bound's second term, and only the others are solved. The
    optimum is unique, so both ways give it to the bit (ties only change which expert attains it)."""
    G, P = topology.num_gpus, topology.num_slots
    if count_LE is None:
        return stats.lower_bound(load_LE, G, P)
    bound_L, proven_L = stats.proven_bound(load_LE, count_LE, G, P)
    if not proven_L.all():
        bound_L[~proven_L] = stats.lower_bound(load_LE[~proven_L], G, P)
    return bound_L


def even_split(rule: DispatchRule, placement: Placement) -> bool:
    """Does `rule` split every expert's tokens evenly among its replicas in `placement`: the
    rule "even", or "plan" for a placement without dispatch weights."""
    return isinstance(rule, EvenSplit) or (isinstance(rule, PlanWeights) and placement.dispatch_weights_LP is None)


def score(placement: Placement, load_LE: np.ndarray, rule: DispatchRule, lower_bound_L: np.ndarray) -> stats.LoadReport:
    """`stats.evaluate(placement, load_LE, rule.bind(placement)(load_LE), lower_bound_L=...)`:
    the placement scored on load_LE [L, E] (float64 of its shape, checked) under the dispatch
    rule. An even split (the rule "even", or "plan" without dispatch weights: greedy, the
    contiguous baseline) goes through `stats.even_report`, the same bits without binding the
    rule or gathering per-slot shares."""
    if even_split(rule, placement):
        return stats.even_report(placement, load_LE, lower_bound_L)
    return stats.evaluate(placement, load_LE, rule.bind(placement)(load_LE), lower_bound_L=lower_bound_L)


@functools.lru_cache(maxsize=16)
def _contiguous(num_logical_experts: int, topology: Topology, layer_ids: tuple[int, ...]) -> Placement:
    """The contiguous baseline `before` scores, kept for the next plan of the same shape (a
    Placement is immutable; a serving loop plans one shape again and again)."""
    return contiguous_placement(num_logical_experts, topology, np.array(layer_ids, dtype=np.int64))


def as_history(loads_or_trace: Any) -> tuple[np.ndarray, np.ndarray | None, dict]:
    """Normalise a Trace, [L, E] or [T, L, E] array into (history_TLE, layer_ids, meta)."""
    if isinstance(loads_or_trace, Trace):
        return loads_or_trace.counts_TLE.astype(np.float64), loads_or_trace.layer_ids, loads_or_trace.meta
    try:  # number_array: asarray(dtype=float64) would read True as 1 and drop imaginary parts
        a = number_array("loads", loads_or_trace).astype(np.float64)
    except EplbError as exc:
        raise EplbError(f"{exc}: give [layers, experts] or [windows, layers, experts] numbers, or a Trace") from None
    if a.ndim == 2:
        a = a[None]
    if a.ndim != 3:
        raise EplbError(f"loads must be [layers, experts] or [windows, layers, experts], got shape {a.shape}")
    if 0 in a.shape:
        raise EplbError(f"loads must not be empty, got shape {a.shape}")
    with np.errstate(over="ignore", invalid="ignore"):
        total = float(a.sum())
    # A finite sum has no inf or NaN among its terms (either would make it inf or NaN), so the
    # element-wise finiteness pass is needed only to tell those from finite loads that overflow.
    if (not np.isfinite(total) and not np.all(np.isfinite(a))) or a.min() < 0:
        raise EplbError("loads must be finite and non-negative")
    if not total <= MAX_COUNT:  # 1e308 loads sum to inf: every score would be NaN
        raise EplbError(f"loads sum to {total:g}, more than 2**62 ({MAX_COUNT:.3g}): scale them down "
                        f"(balance does not depend on the unit)")
    return a, None, {}


def size_topology(num_logical_experts: int, topology: Topology | None = None, *, num_gpus=None, num_nodes=1,
                  num_redundant=None, slots_per_gpu=None, num_layers: int | None = None) -> Topology:
    """The Topology a plan of E logical experts runs on: `topology` itself, or one sized from
    num_gpus, num_nodes and num_redundant / slots_per_gpu (Topology.for_experts); either, not both.

    Refused only what cannot be filled: more slots per GPU than experts (a GPU would need two
    copies of one expert), fewer slots than experts. More GPUs than experts is planned (each
    expert then has several replicas). With `num_layers`, an [L, P] map larger than the input
    limit (eplb.core.files; 10**11 GPUs typed by mistake) is refused too. Checked before any planner
    allocates [L, P].
    """
    E = num_logical_experts
    if topology is not None:
        if not isinstance(topology, Topology):
            raise EplbError(f"topology must be an eplb.Topology (num_gpus, slots_per_gpu, num_nodes), "
                            f"got {type(topology).__name__}")
        given = [f"{k}={v!r}" for k, v in (("num_gpus", num_gpus), ("num_redundant", num_redundant),
                                           ("slots_per_gpu", slots_per_gpu)) if v is not None]
        given += [f"num_nodes={num_nodes!r}"] if num_nodes != 1 else []
        if given:
            raise EplbError(f"give either topology ({topology}) or the sizes ({', '.join(given)}), not both")
        topo = topology
        if topo.num_slots < E:
            raise EplbError(f"{topo.num_gpus} GPUs x {topo.slots_per_gpu} slots = {topo.num_slots} slots cannot "
                            f"hold {E} logical experts: use at least {-(-E // topo.num_gpus)} slots per GPU")
    else:
        if num_gpus is None:
            raise EplbError("give the GPUs to plan for: num_gpus=G (with num_nodes, num_redundant or "
                            "slots_per_gpu), or topology=eplb.Topology(...)")
        num_gpus = whole_number("num_gpus", num_gpus, 1)
        num_nodes = whole_number("num_nodes", num_nodes, 1)
        num_redundant = None if num_redundant is None else whole_number("num_redundant", num_redundant, 0)
        slots_per_gpu = None if slots_per_gpu is None else whole_number("slots_per_gpu", slots_per_gpu, 0)
        topo = Topology.for_experts(E, num_gpus=num_gpus, num_nodes=num_nodes, num_redundant=num_redundant,
                                    slots_per_gpu=slots_per_gpu)
    # More GPUs than experts is fine (Mixtral's 8 experts on 16 GPUs x 2 slots): every GPU can
    # be filled with distinct experts exactly when S <= E and P >= E (slot p holding p % E does it).
    if topo.slots_per_gpu > E:
        raise EplbError(
            f"{topo.slots_per_gpu} slots per GPU ({topo.num_slots} in total) exceed the {E} logical "
            f"experts: a GPU cannot fill them without two copies of one expert, which serve nothing a "
            f"single copy does not; use at most {E} slots per GPU (num_redundant <= {topo.num_gpus * E - E})"
        )
    if num_layers is not None:
        need, limit = 8 * num_layers * topo.num_slots, max_input_bytes()
        if need > limit:
            raise EplbError(f"{topo.num_gpus} GPUs x {topo.slots_per_gpu} slots: a map of {num_layers} layers x "
                            f"{topo.num_slots} slots would take {format_size(need)}, more than the input limit of "
                            f"{format_size(limit)} ({MAX_INPUT_ENV}): fewer GPUs, or raise the limit")
    return topo


def _check_migration(previous, budget, L: int, E: int, topo: Topology, layer_ids) -> None:
    """previous (the served Placement, of this plan's shape) and budget (needs previous)."""
    if budget is not None and not isinstance(budget, Budget):
        raise EplbError(f"budget must be an eplb.Budget (max_moves, max_moves_per_gpu, move_cost, span_cost, "
                        f"bytes_per_expert), got {type(budget).__name__}")
    if previous is None:
        if budget is not None:
            # Refused, not ignored: a budget only prices or counts migration from `previous`.
            given = [f"{f.name} ({getattr(budget, f.name)!r})" for f in fields(Budget)
                     if getattr(budget, f.name) != f.default]
            raise EplbError(f"{', '.join(given) or 'a budget'}: migration options need the placement "
                            f"now served (previous=... / --previous OLD.json); drop them for a plan from scratch")
        return
    if not isinstance(previous, Placement):
        raise EplbError(f"previous must be a Placement (the one now served, e.g. eplb.load_placement('old.json')), "
                        f"got {type(previous).__name__}")
    if previous.phy2log_LP.shape != (L, topo.num_slots) or previous.num_logical_experts != E:
        raise EplbError(
            f"previous placement is {previous.num_layers} layers x {previous.num_slots} slots of "
            f"{previous.num_logical_experts} experts; this plan needs {L} x {topo.num_slots} of {E}: "
            f"plan for the same slots (num_gpus={previous.num_gpus}, slots_per_gpu={previous.slots_per_gpu}) "
            f"on a trace of the same model"
        )
    if layer_ids is not None:  # loads from a Trace name their layers: the served plan must be for them
        check_same_layers(previous, layer_ids, placement_name="previous placement", trace_name="the loads")


def plan(
    loads: Any,
    *,
    topology: Topology | None = None,
    num_gpus: int | None = None,
    num_nodes: int = 1,
    num_redundant: int | None = None,
    slots_per_gpu: int | None = None,
    planner: str | None = None,
    settings: Mapping | None = None,
    aggregate: str | Aggregation = "sum",
    num_expert_groups: int | None = None,
    previous: Placement | None = None,
    budget: Budget | None = None,
    dispatch: str | DispatchRule | None = None,
    objective: str | TimeObjective = "tokens",
    resplit_rounds: int = PLAN_ROUNDS,
) -> PlanResult:
    """Plan an expert placement: the one front door for the API and the CLI.

    loads: a Trace, or counts [L, E] / [T, L, E]. Windows are history: `aggregate` (a name,
    "sum", "mean", "last", "window", "ema", or an eplb.stats.Aggregation with its window /
    alpha) makes them the planning load, and planners that plan against every window (robust)
    get them whole.
    Where: `topology` (an eplb.Topology), or `num_gpus`, `num_nodes` and `num_redundant` slots in
    total or `slots_per_gpu` (default one redundant slot per GPU); whole numbers only (2.5 or
    "4" are refused, not truncated). `num_expert_groups` defaults to the trace's.
    Migration (eplb.migration): with `previous`, the placement now served, the plan is relabelled
    to keep the most of its replicas in place; `budget` (an eplb.Budget: max_moves,
    max_moves_per_gpu, move_cost, span_cost, bytes_per_expert) bounds and prices the copies (a
    budgeted search from `previous` then competes with the relabelled plan). Under a rule whose
    shares follow the layout (SGLang's) every candidate is judged by binding that rule
    (eplb.migration.rule; the rule-aware planner fits its plan to `previous` itself), and with a
    budget no layer is served worse than keeping `previous`. Moves (and bytes) are reported in
    info["migration"]. A budget without `previous` is refused.
    dispatch: the rule the engine will apply (eplb.dispatch.get_rule: a name or a DispatchRule;
    default "plan", the plan's own weights, else an even split; an engine's rule is
    eplb.dispatch.engine_rule("sglang"), ...). Planners read it from the request; the result's
    reports are scored under it (`PlanResult.served`). `planner` None picks "rule-aware" for
    rules whose shares depend on the layout (SGLang's), else "greedy".
    objective: "tokens" (balance token loads), or an eplb.dispatch.cost.TimeObjective (balance modeled
    per-GPU time: planners, and the migration step, see each expert's expected seconds per step
    on one replica instead of its tokens); the result is still scored in tokens, and
    info["objective"] says what was planned for.
    Under a rule that re-splits every batch over an expert's replicas (`resplit`, `optimal`,
    SGLang's `lp`) the plan is then searched under the re-split score on the planning windows
    (`plan_for_resplit`, `resplit_rounds` passes; 0: the planner's plan, scored only).
    """
    if settings is not None and not isinstance(settings, Mapping):
        raise EplbError(f"settings must be a dict of planner settings (e.g. {{'quantile': 0.9}}), "
                        f"got {type(settings).__name__}")
    if num_expert_groups is not None:
        num_expert_groups = whole_number("num_expert_groups", num_expert_groups, 1)
    rule = get_rule("plan" if dispatch is None else dispatch)
    objective = check_objective(objective)
    resplit_rounds = whole_number("resplit_rounds", resplit_rounds, 0)
    _check_resplit_objective(rule, objective)  # before the planner runs
    agg = stats.as_aggregation(aggregate)
    history_TLE, layer_ids, meta = as_history(loads)
    load_LE = agg(history_TLE)
    L, E = load_LE.shape
    if num_expert_groups is not None and E % num_expert_groups:
        raise EplbError(f"{E} experts do not split into {num_expert_groups} equal expert groups: group-limited "
                        f"routing uses equal contiguous groups, so give num_expert_groups (--expert-groups) "
                        f"dividing {E}")
    topo = size_topology(E, topology, num_gpus=num_gpus, num_nodes=num_nodes, num_redundant=num_redundant,
                         slots_per_gpu=slots_per_gpu, num_layers=L)
    _check_migration(previous, budget, L, E, topo, layer_ids)
    if num_expert_groups is None and meta.get("num_expert_groups"):
        num_expert_groups = int(meta["num_expert_groups"])
    topk_ids_NLK = loads.topk_ids_NLK if isinstance(loads, Trace) else None
    request = PlanRequest(load_LE, topo, history_TLE, layer_ids, num_expert_groups, previous, rule, objective,
                          topk_ids_NLK)
    if objective != "tokens":
        # Planners balance whatever load they are given: hand them expected seconds per expert.
        request = replace(request, load_LE=objective.planning_load(load_LE, topo),
                          history_TLE=objective.planning_load(history_TLE, topo))
    if planner is None:
        planner = "rule-aware" if layout_dependent(rule) else "greedy"
    impl = get_planner(planner, **(settings or {}))
    t0 = time.perf_counter()
    sol = impl.plan(request)
    seconds = time.perf_counter() - t0
    if sol.status not in STATUSES:
        raise AssertionError(f"planner {planner} returned unknown status {sol.status!r}")
    if previous is not None:
        budget = budget or Budget()
        sol = migration.adapt_solution(request, sol, budget)
    if objective != "tokens":
        sol = replace(sol, info={**sol.info, "objective": objective.describe(topo.num_gpus)})
    # Scored on the token load, whatever the planner balanced.
    result = PlanResult(sol, planner, seconds, load_LE, topo, rule, layer_ids, objective)
    if re_splits(rule) and resplit_rounds:
        result = plan_for_resplit(result, resplit_windows(history_TLE, agg), previous, budget, resplit_rounds)
    return result


def _check_resplit_objective(rule: DispatchRule, objective) -> None:
    """A rule that re-splits every batch balances token counts: refuse the time objective under it."""
    if re_splits(rule) and objective != "tokens":
        raise EplbError(f"dispatch {rule.name!r} re-splits the token counts of every batch: plan for tokens "
                        f"(drop --objective time), or plan for an even split")


def resplit_windows(history_TLE: np.ndarray, aggregation: Aggregation) -> np.ndarray:
    """The windows a plan for a re-split rule is searched and scored on, float64 [M, L, E]: the
    history's (the newest `window` of them for "window", the newest for "last"): the windows the
    planning load was made of, each served by its own split."""
    counts = np.asarray(history_TLE, dtype=np.float64)
    if aggregation.how == "window":
        return counts[-aggregation.window:] if aggregation.window else counts
    return counts[-1:] if aggregation.how == "last" else counts


def plan_for_resplit(result: PlanResult, history_TLE, previous: Placement | None = None,
                     budget: Budget | None = None, rounds: int = PLAN_ROUNDS) -> PlanResult:
    """`result` (a plan for a rule that re-splits every batch) searched under the re-split score
    on the windows history_TLE [M, L, E] (eplb.planning.resplit_plan); info["resplit"] says
    what it did. `plan` calls it; `eplb plan --dispatch resplit` calls it on the planner's plan
    to report both."""
    if not re_splits(result.dispatch):
        raise EplbError(f"dispatch {result.dispatch.name!r} does not re-split each batch: plan for "
                        f"'resplit', 'optimal' or SGLang's 'lp', or keep the plan as it is")
    _check_resplit_objective(result.dispatch, result.objective)
    sol = search_solution(result.solution, result.topology, result.dispatch, result.layer_ids, history_TLE,
                          previous, budget, rounds)
    return replace(result, solution=sol)

