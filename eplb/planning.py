"""Planning front door: the Planner protocol, the registry, PlanResult and `plan()`.

Legend: T = windows, L = MoE layers, E = logical experts, G = GPUs, P = physical slots.

Planners live in the top-level `planners/` package, one module per algorithm, each class
registered by name with `@register("name")`. A planner's constructor only stores settings;
`plan(request) -> Solution` does the work on numpy arrays and a Topology, never files or
torch. `plan()` below is the one front door: it normalises input, sizes the topology, runs
the planner, times it and scores the result against the contiguous (no-EPLB) baseline and
the lower bound.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from eplb import stats
from eplb.dispatch import get_rule
from eplb.errors import EplbError, whole_number
from eplb.placement import Placement
from eplb.topology import Topology
from eplb.trace import Trace

STATUSES = ("OPTIMAL", "FEASIBLE", "HEURISTIC", "FALLBACK")


@dataclass(frozen=True, eq=False)
class PlanRequest:
    """Everything a planner may look at."""

    load_LE: np.ndarray
    """Planning load (windows aggregated), float64 [L, E]."""
    topology: Topology
    """GPUs, nodes and slots per GPU."""
    history_TLE: np.ndarray | None = None
    """The individual windows the load was aggregated from, float64 [T, L, E] (robust planners)."""
    layer_ids: np.ndarray | None = None
    """Hidden-layer index of each MoE layer [L]."""
    num_expert_groups: int | None = None
    """Expert groups of group-limited routing (DeepSeek-V3: 8), for node-aware planners."""
    previous: Placement | None = None
    """The placement now being served (migration-aware planners keep its replicas in place)."""
    dispatch: Any = None
    """The dispatch rule the engine will apply (eplb.dispatch.DispatchRule), or None: the plan's
    own weights, an even split without them. Rule-aware planners plan for it."""

    @property
    def num_layers(self) -> int:
        return self.load_LE.shape[0]

    @property
    def num_logical_experts(self) -> int:
        return self.load_LE.shape[1]


@dataclass(frozen=True, eq=False)
class Solution:
    """What a planner returns."""

    phy2log_LP: np.ndarray
    """Logical expert in each physical slot, [L, P]."""
    dispatch_weights_LP: np.ndarray | None = None
    """Per-replica token shares, or None for an even split."""
    status: str = "HEURISTIC"
    """OPTIMAL (proven), FEASIBLE (solver stopped early), HEURISTIC, or FALLBACK (the
    planner could not do its own job and returned another planner's answer; see message)."""
    message: str = ""
    info: dict = field(default_factory=dict)
    """Planner-specific numbers (gaps, solver statistics), JSON-serialisable."""


class Planner(Protocol):
    name: str

    def plan(self, request: PlanRequest) -> Solution: ...


_REGISTRY: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a planner available under `name` everywhere (API and CLI)."""

    def deco(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise RuntimeError(f"planner name {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_builtin() -> None:
    importlib.import_module("planners")


def planner_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def planner_settings(name: str) -> list[str]:
    """Names of the settings a registered planner's constructor takes."""
    import inspect

    _load_builtin()
    if name not in _REGISTRY:
        raise EplbError(f"unknown planner {name!r}: choose one of {', '.join(sorted(_REGISTRY))}")
    params = inspect.signature(_REGISTRY[name]).parameters
    return [k for k in params if k != "self"]


def get_planner(name: str, **settings: Any) -> Planner:
    _load_builtin()
    if name not in _REGISTRY:
        raise EplbError(f"unknown planner {name!r}: choose one of {', '.join(sorted(_REGISTRY))}")
    import inspect

    params = inspect.signature(_REGISTRY[name]).parameters
    known = [k for k, p in params.items() if k != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    unknown = [] if takes_any else [k for k in settings if k not in known]
    if unknown:  # named alone: the CLI adds quiet=True itself, which the user never typed
        raise EplbError(f"planner {name!r} does not take these settings: {', '.join(map(repr, unknown))}; "
                        f"its settings are {', '.join(known) or 'none'}")
    try:
        return _REGISTRY[name](**settings)
    except EplbError:
        raise
    except TypeError as exc:
        raise EplbError(f"planner {name!r} does not take these settings ({settings!r}): {exc}") from None
    except ValueError as exc:  # e.g. float("abc") on a setting given as text (--set key=abc)
        raise EplbError(f"planner {name!r}: a setting has a value of the wrong type ({settings!r}): {exc}") from None


def whole_setting(name: str, value: Any, minimum: int = 0) -> int:
    """A planner setting that must be a whole number >= minimum (2.7, True or "x" are refused)."""
    return whole_number(name, value, minimum)


@dataclass(frozen=True, eq=False)
class PlanResult:
    """A placement plus how it was made and how good it is (scored on the planning load)."""

    placement: Placement
    planner: str
    status: str
    success: bool
    message: str
    seconds: float
    """Wall time of the planner alone."""
    load_LE: np.ndarray
    """The load the plan was scored on, [L, E]."""
    lower_bound_L: np.ndarray
    """Lower bound on the busiest GPU's load per layer, [L]."""
    before: stats.LoadReport
    """Contiguous placement (no EPLB) on the same GPUs."""
    after: stats.LoadReport
    """The plan under its own dispatch weights (an even split without them)."""
    info: dict = field(default_factory=dict)
    dispatch: str | None = None
    """Name of the dispatch rule the plan was scored under (`served`), or None."""
    served: stats.LoadReport | None = None
    """The plan as the engine serves it: under `dispatch` (None without a rule)."""

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary (what `eplb plan --json` prints)."""
        return {
            "planner": self.planner,
            "status": self.status,
            "success": self.success,
            "message": self.message,
            "seconds": self.seconds,
            "num_layers": self.placement.num_layers,
            "num_logical_experts": self.placement.num_logical_experts,
            "num_gpus": self.placement.num_gpus,
            "num_nodes": self.placement.num_nodes,
            "num_slots": self.placement.num_slots,
            "before": self.before.summary(),
            "after": self.after.summary(),
            "dispatch": self.dispatch,
            "served": None if self.served is None else self.served.summary(),
            "info": self.info,
        }


def as_history(loads_or_trace: Any) -> tuple[np.ndarray, np.ndarray | None, dict]:
    """Normalise a Trace, [L, E] or [T, L, E] array into (history_TLE, layer_ids, meta)."""
    if isinstance(loads_or_trace, Trace):
        return loads_or_trace.counts_TLE.astype(np.float64), loads_or_trace.layer_ids, loads_or_trace.meta
    try:
        a = np.asarray(loads_or_trace, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise EplbError(f"loads must be a rectangular array of numbers [layers, experts] or "
                        f"[windows, layers, experts], or a Trace ({exc})") from None
    if a.ndim == 2:
        a = a[None]
    if a.ndim != 3:
        raise EplbError(f"loads must be [layers, experts] or [windows, layers, experts], got shape {a.shape}")
    if not np.all(np.isfinite(a)) or (a.size and a.min() < 0):
        raise EplbError("loads must be finite and non-negative")
    if 0 in a.shape:
        raise EplbError(f"loads must not be empty, got shape {a.shape}")
    return a, None, {}


def plan(
    loads_or_trace: Any,
    *,
    num_gpus: int,
    num_nodes: int = 1,
    num_redundant: int | None = None,
    slots_per_gpu: int | None = None,
    planner: str | None = None,
    aggregate: str = "sum",
    window: int | None = None,
    alpha: float | None = None,
    num_expert_groups: int | None = None,
    previous: Placement | None = None,
    settings: dict | None = None,
    max_moves: int | None = None,
    max_moves_per_gpu: int | None = None,
    move_cost: float = 0.0,
    bytes_per_expert: int | None = None,
    span_cost: float | None = None,
    dispatch: Any = None,
) -> PlanResult:
    """Plan an expert placement: the one front door for the API and the CLI.

    loads_or_trace: a Trace, or counts [L, E] / [T, L, E]. Windows are history: they are
    aggregated with `aggregate` ("sum", "mean", "last", "window", "ema") into the planning
    load, and passed whole to planners that plan against every window (robust ones).
    Topology: `num_gpus`, `num_nodes`, and `num_redundant` slots in total or `slots_per_gpu` (default one
    redundant slot per GPU). `num_expert_groups` defaults to the trace's `num_expert_groups`.
    Migration (eplb.migration): with `previous`, the plan is relabelled to keep the most of
    its replicas in place; `max_moves` (total), `max_moves_per_gpu` and `move_cost` bound how
    many replicas may be copied (a budgeted search from `previous` then competes with the
    relabelled plan). Moves (and bytes, given `bytes_per_expert`) are reported in `info`.
    With num_nodes > 1 and expert groups, `span_cost` prices spreading a group onto one more node
    in moves (eplb.migration.Budget.span_cost, default 1), so that search keeps node locality.
    Whole-number arguments (num_gpus, num_nodes, num_redundant, slots_per_gpu, num_expert_groups) refuse 2.5 or
    "4" rather than truncate them; the migration options without `previous` are refused.
    Dispatch: `dispatch` is the rule the engine applies (a name from eplb.dispatch.RULES or a rule,
    e.g. `eplb.dispatch.engine_rule("sglang")`); the plan is then also scored under it
    (`PlanResult.served`). `planner` None picks "rule-aware" for rules whose shares depend on
    the layout (SGLang's), else "greedy".
    """
    num_gpus = whole_setting("num_gpus", num_gpus, 1)
    num_nodes = whole_setting("num_nodes", num_nodes, 1)
    num_redundant = None if num_redundant is None else whole_setting("num_redundant", num_redundant, 0)
    slots_per_gpu = None if slots_per_gpu is None else whole_setting("slots_per_gpu", slots_per_gpu, 0)
    if num_expert_groups is not None:
        num_expert_groups = whole_setting("num_expert_groups", num_expert_groups, 1)
    if settings is not None and not isinstance(settings, Mapping):
        raise EplbError(f"settings must be a dict of planner settings (e.g. {{'quantile': 0.9}}), "
                        f"got {type(settings).__name__}")
    if previous is not None and not isinstance(previous, Placement):
        raise EplbError(f"previous must be a Placement (the one now served, e.g. Placement.load('old.json')), "
                        f"got {type(previous).__name__}")
    if previous is None:
        # Checked before planning: these only price or count migration from `previous`.
        given = [f"{k} ({v!r})" for k, v in (("max_moves", max_moves), ("max_moves_per_gpu", max_moves_per_gpu),
                                             ("move_cost", move_cost or None), ("span_cost", span_cost),
                                             ("bytes_per_expert", bytes_per_expert)) if v is not None]
        if given:
            raise EplbError(f"{', '.join(given)}: migration options need the placement now served "
                            f"(previous=... / --previous OLD.json); drop them for a plan from scratch")
    history_TLE, layer_ids, meta = as_history(loads_or_trace)
    load_LE = stats.aggregate(history_TLE, aggregate, window=window, alpha=alpha)
    L, E = load_LE.shape
    if num_expert_groups is not None and E % num_expert_groups:
        raise EplbError(f"{E} experts do not split into {num_expert_groups} equal expert groups: group-limited "
                        f"routing uses equal contiguous groups, so give num_expert_groups (--expert-groups) "
                        f"dividing {E}")
    topo = Topology.for_experts(E, num_gpus=num_gpus, num_nodes=num_nodes, num_redundant=num_redundant,
                                slots_per_gpu=slots_per_gpu)
    if topo.num_gpus > E:
        raise EplbError(
            f"more GPUs ({topo.num_gpus}) than logical experts ({E}): expert parallelism over more ranks "
            f"than experts leaves ranks without an expert of their own; use at most {E} GPUs"
        )
    if topo.slots_per_gpu > E:
        # Checked here, before any planner or the contiguous baseline allocates [L, P] arrays:
        # a GPU with more slots than experts must hold two copies of one, which never helps.
        raise EplbError(
            f"{topo.slots_per_gpu} slots per GPU ({topo.num_slots} in total) exceed the {E} logical "
            f"experts: a GPU never needs two copies of one expert; use at most {E} slots per GPU "
            f"(num_redundant <= {topo.num_gpus * E - E})"
        )
    if num_expert_groups is None and meta.get("num_expert_groups"):
        num_expert_groups = int(meta["num_expert_groups"])
    if previous is not None:
        if previous.phy2log_LP.shape != (L, topo.num_slots) or previous.num_logical_experts != E:
            raise EplbError(
                f"previous placement is {previous.num_layers} layers x {previous.num_slots} slots of "
                f"{previous.num_logical_experts} experts; this plan needs {L} x {topo.num_slots} of {E}: "
                f"plan for the same slots (num_gpus={previous.num_gpus}, slots_per_gpu={previous.slots_per_gpu}) "
                f"on a trace of the same model"
            )
    rule = None if dispatch is None else get_rule(dispatch)
    if planner is None:
        planner = "rule-aware" if rule is not None and _layout_dependent(rule) else "greedy"
    request = PlanRequest(load_LE, topo, history_TLE, layer_ids, num_expert_groups, previous, rule)
    impl = get_planner(planner, **(settings or {}))
    t0 = time.perf_counter()
    sol = impl.plan(request)
    seconds = time.perf_counter() - t0
    if previous is not None:
        from eplb import migration

        budget = migration.Budget(max_moves, max_moves_per_gpu, move_cost, 1.0 if span_cost is None else span_cost)
        sol = migration.adapt_solution(request, sol, budget, bytes_per_expert)
    return finish(request, sol, planner, seconds)


def finish(request: PlanRequest, sol: Solution, planner: str, seconds: float) -> PlanResult:
    """Wrap a planner's Solution into a scored PlanResult."""
    topo = request.topology
    if sol.status not in STATUSES:
        raise AssertionError(f"planner {planner} returned unknown status {sol.status!r}")
    placement = Placement(
        phy2log_LP=sol.phy2log_LP,
        num_gpus=topo.num_gpus,
        num_logical_experts=request.num_logical_experts,
        num_nodes=topo.num_nodes,
        layer_ids=request.layer_ids,
        dispatch_weights_LP=sol.dispatch_weights_LP,
        planner=planner,
    )
    from planners.contiguous import contiguous_placement

    baseline = contiguous_placement(placement)
    lb = stats.lower_bound(request.load_LE, topo.num_gpus, topo.num_slots)
    before = stats.evaluate(baseline, request.load_LE, lower_bound_L=lb)
    after = stats.evaluate(placement, request.load_LE, lower_bound_L=lb)
    metrics = {
        "imbalance_median": float(np.median(after.imbalance_L)),
        "imbalance_max": float(np.max(after.imbalance_L)),
        "bound_ratio_max": float(np.max(after.bound_ratio_L)),
        "balancedness": after.balancedness,
        "contiguous_imbalance_median": float(np.median(before.imbalance_L)),
    }
    served = None
    rule = request.dispatch
    if rule is not None:
        served = stats.evaluate(placement, request.load_LE, rule.bind(placement)(request.load_LE), lower_bound_L=lb)
        metrics.update({"dispatch": rule.name, "served_imbalance_median": float(np.median(served.imbalance_L)),
                        "served_imbalance_max": float(np.max(served.imbalance_L))})
    placement = Placement(placement.phy2log_LP, placement.num_gpus, placement.num_logical_experts,
                          placement.num_nodes, placement.layer_ids, placement.dispatch_weights_LP,
                          planner, metrics)
    return PlanResult(
        placement=placement, planner=planner, status=sol.status,
        success=sol.status != "FALLBACK", message=sol.message, seconds=seconds,
        load_LE=request.load_LE, lower_bound_L=lb, before=before, after=after, info=dict(sol.info),
        dispatch=None if rule is None else rule.name, served=served,
    )


def _layout_dependent(rule) -> bool:
    """True for rules whose shares depend on where replicas are (SGLang's), not only on counts."""
    from eplb.sglang_dispatch import SglangDynamic, SglangStatic

    return isinstance(rule, (SglangStatic, SglangDynamic))
