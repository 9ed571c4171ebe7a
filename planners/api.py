"""The planner contract: the `Planner` protocol, `PlanRequest`, `Solution`, and the planner table.

Legend: T = windows, L = MoE layers, E = logical experts, P = physical slots.

A planner is a class with a `name` and `plan(request) -> Solution`; its constructor only stores
settings. Planners work on numpy arrays and a Topology, never files or torch, and import only
this module and lower layers (docs/design.md), so the front door (`eplb.planning.plan`) finds
them here without the planners knowing about it.

Where planners come from, in the order names are looked up:
1. `register(name, cls)`: a class made at run time (tests, notebooks).
2. `PLANNERS`: the built-in table, name -> "module:Class", imported on first use. Nothing
   registers by import side effect: `planners/__init__.py` imports nothing.
3. The `eplb.planners` entry-point group (importlib.metadata): third-party packages declare
   `[project.entry-points."eplb.planners"] myplanner = "mypkg.module:MyPlanner"`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from eplb.core.placement import Placement
from eplb.core.topology import Topology
from eplb.dispatch.cost import TimeObjective
from eplb.dispatch.rules import DispatchRule, PlanWeights
from eplb.errors import EplbError, a_name

STATUSES = ("OPTIMAL", "FEASIBLE", "HEURISTIC", "FALLBACK")
"""OPTIMAL (proven), FEASIBLE (a solver stopped early), HEURISTIC, FALLBACK (the planner could not
do its own job and returned another planner's answer; its message says so)."""

PLANNERS: dict[str, str] = {
    "contiguous": "planners.contiguous:ContiguousPlanner",
    "deepseek": "planners.deepseek:DeepSeekPlanner",
    "greedy": "planners.greedy:GreedyPlanner",
    "hierarchical": "planners.hierarchical:HierarchicalPlanner",
    "ilp": "planners.ilp:IlpPlanner",
    "robust": "planners.robust:RobustPlanner",
    "rule-aware": "planners.rule_aware:RuleAwarePlanner",
    "traffic": "planners.traffic:TrafficPlanner",
}
"""Built-in planners: name -> "module:Class" (a test checks it against the CLI's --planner choices)."""

ENTRY_POINT_GROUP = "eplb.planners"


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
    dispatch: DispatchRule = field(default_factory=PlanWeights)
    """How the engine will split each expert's tokens among its replicas (eplb.dispatch); the
    default, "plan", serves the plan's own weights (an even split when it has none)."""
    objective: str | TimeObjective = "tokens"
    """What load_LE and history_TLE hold: "tokens", or, for an `eplb.dispatch.cost.TimeObjective`, each
    expert's expected seconds per step on one replica (the front door converts them)."""
    topk_ids_NLK: np.ndarray | None = None
    """Per-token expert choices [N, L, K] when the trace carries them (traffic-aware planners)."""

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
    """One of STATUSES."""
    message: str = ""
    info: dict = field(default_factory=dict)
    """Planner-specific numbers (gaps, solver statistics), JSON-serialisable."""


class Planner(Protocol):
    name: str

    def plan(self, request: PlanRequest) -> Solution: ...


_registered: dict[str, type] = {}
_entry_points: dict[str, Any] | None = None


def register(name: str, cls: type) -> type:
    """Make a planner class made at run time available under `name` (API and CLI choices).

    Built-in names and names taken by another class are refused; registering the same class
    twice is a no-op. The class's `name` attribute is set to `name` when it has none."""
    if not isinstance(name, str) or not name:
        raise EplbError(f"a planner name must be a non-empty string, got {name!r}")
    if not callable(getattr(cls, "plan", None)):
        raise EplbError(f"planner {name!r}: {getattr(cls, '__name__', cls)!r} has no plan(request) method")
    own = getattr(cls, "name", None)
    if own is not None and own != name:
        raise EplbError(f"planner class {cls.__name__} is named {own!r}, not {name!r}")
    taken = _registered.get(name)
    if name in PLANNERS or (taken is not None and taken is not cls):
        raise EplbError(f"planner name {name!r} is taken: choose another name")
    cls.name = name
    _registered[name] = cls
    return cls


def _plugins() -> dict[str, Any]:
    """Entry points of the `eplb.planners` group, by name (read once, loaded on first use)."""
    global _entry_points
    if _entry_points is None:
        from importlib.metadata import entry_points

        found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
        clash = sorted(set(found) & set(PLANNERS))
        if clash:
            raise EplbError(f"entry points of group {ENTRY_POINT_GROUP!r} reuse built-in planner name(s) "
                            f"{', '.join(clash)}: rename them in the package that declares them")
        _entry_points = found
    return _entry_points


def planner_names() -> list[str]:
    """Every planner name: built-in, registered at run time and from entry points, sorted."""
    return sorted(set(PLANNERS) | set(_registered) | set(_plugins()))


def planner_class(name: str) -> type:
    """The planner class behind `name` (imported on first use)."""
    if not isinstance(name, str):  # a list or an array would fail the lookups below with TypeError
        a_name("planner", name, planner_names())
    if name in _registered:
        return _registered[name]
    if name in PLANNERS:
        module, _, attr = PLANNERS[name].partition(":")
        return getattr(importlib.import_module(module), attr)
    plugins = _plugins()
    if name in plugins:
        cls = plugins[name].load()
        if not callable(getattr(cls, "plan", None)):
            raise EplbError(f"entry point {name!r} ({plugins[name].value}) is not a planner class with plan()")
        return cls
    raise EplbError(f"unknown planner {name!r}: choose one of {', '.join(planner_names())}")


@functools.cache
def _settings_of(cls: type) -> tuple[tuple[str, ...], bool]:
    """(names of the constructor's settings, whether it takes **kwargs), read once per class."""
    params = inspect.signature(cls).parameters
    known = tuple(k for k, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    return known, any(p.kind == p.VAR_KEYWORD for p in params.values())


def planner_settings(name: str) -> list[str]:
    """Names of the settings a planner's constructor takes."""
    return list(_settings_of(planner_class(name))[0])


def setting_value(text: str) -> Any:
    """A planner setting typed as text (`--set key=value`, an engine's environment variable):
    int, then float, then true/false, else the text itself."""
    text = text.strip()
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def get_planner(name: str, **settings: Any) -> Planner:
    """A planner by name, built with `settings` (unknown settings and bad values are EplbError)."""
    cls = planner_class(name)
    known, takes_any = _settings_of(cls)
    unknown = [] if takes_any else [k for k in settings if k not in known]
    if unknown:  # named alone: the CLI adds quiet=True itself, which the user never typed
        raise EplbError(f"planner {name!r} does not take these settings: {', '.join(map(repr, unknown))}; "
                        f"its settings are {', '.join(known) or 'none'}")
    try:
        return cls(**settings)
    except EplbError:
        raise
    except TypeError as exc:
        raise EplbError(f"planner {name!r} does not take these settings ({settings!r}): {exc}") from None
    except ValueError as exc:  # e.g. float("abc") on a setting given as text (--set key=abc)
        raise EplbError(f"planner {name!r}: a setting has a value of the wrong type ({settings!r}): {exc}") from None
