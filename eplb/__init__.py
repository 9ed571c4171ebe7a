"""eplb: expert-parallel load balancing for Mixture-of-Experts serving.

Pipeline: collect (eplb.runtime.collect, importers in eplb.formats) -> statistics (eplb.stats) ->
plan (eplb.plan, planners in the `planners` package) -> apply (exports in eplb.formats,
eplb.runtime) -> see (CLI reports, plots, backtests). torch is imported only by collectors,
the runtime and the `.pt` importer/exporter.

The names below are re-exported on first use (PEP 562), not at import: the package's own
modules import `eplb.errors` and friends, which runs this file first, and the planners sit below
the policy and the Rebalancer. An eager re-export would import the upper layers before the
lower ones finished (`import planners.robust` alone would fail on the cycle), and would make a
side process that compiles one kernel import the whole toolkit.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from eplb._version import __version__ as __version__

_EXPORTS = {
    "EplbError": "eplb.errors", "PlanningError": "eplb.errors",
    "load_history": "eplb.formats", "load_placement": "eplb.formats", "load_trace": "eplb.formats",
    "save_placement": "eplb.formats", "save_trace": "eplb.formats",
    "Budget": "eplb.migration", "MigrationPlan": "eplb.migration",
    "Placement": "eplb.core.placement",
    "PlanRequest": "planners.api", "Solution": "planners.api", "get_planner": "planners.api",
    "planner_names": "planners.api", "register": "planners.api",
    "PlanResult": "eplb.planning", "plan": "eplb.planning",
    "get_policy": "eplb.serving.policy",
    "Rebalancer": "eplb.serving.rebalance", "RebalanceResult": "eplb.serving.decisions",
    "ReplayResult": "eplb.evaluate.replay_result", "Scoring": "eplb.evaluate.replay", "replay": "eplb.evaluate.replay",
    "LoadReport": "eplb.stats", "evaluate": "eplb.stats", "lower_bound": "eplb.stats",
    "Topology": "eplb.core.topology",
    "Trace": "eplb.core.trace",
}

__all__ = [  # a literal, so linters and editors read it; a test checks it names _EXPORTS
    "Budget", "EplbError", "LoadReport", "MigrationPlan", "Placement", "PlanRequest", "PlanResult",
    "PlanningError", "RebalanceResult", "Rebalancer", "ReplayResult", "Scoring", "Solution", "Topology",
    "Trace", "evaluate", "get_planner", "get_policy", "load_history", "load_placement", "load_trace",
    "lower_bound", "plan", "planner_names", "register", "replay", "save_placement", "save_trace",
]

if TYPE_CHECKING:  # what editors and type checkers see; at run time __getattr__ imports on use
    from eplb.core.placement import Placement
    from eplb.core.topology import Topology
    from eplb.core.trace import Trace
    from eplb.errors import EplbError, PlanningError
    from eplb.evaluate.replay import Scoring, replay
    from eplb.evaluate.replay_result import ReplayResult
    from eplb.formats import load_history, load_placement, load_trace, save_placement, save_trace
    from eplb.migration import Budget, MigrationPlan
    from eplb.planning.front_door import PlanResult, plan
    from eplb.serving.decisions import RebalanceResult
    from eplb.serving.policy import get_policy
    from eplb.serving.rebalance import Rebalancer
    from eplb.stats.loads import LoadReport, evaluate, lower_bound
    from planners.api import PlanRequest, Solution, get_planner, planner_names, register


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'eplb' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
