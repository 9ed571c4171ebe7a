"""eplb: expert-parallel load balancing for Mixture-of-Experts serving.

Pipeline: collect (eplb.collect, importers in eplb.formats) -> statistics (eplb.stats) ->
plan (eplb.plan, planners in the `planners` package) -> apply (exports in eplb.formats,
eplb.runtime) -> see (CLI reports, plots, backtests). torch is imported only by collectors,
the runtime and the `.pt` importer/exporter.
"""

from eplb._version import __version__ as __version__
from eplb.errors import EplbError, PlanningError
from eplb.formats import load_history, load_placement, load_trace, save_placement, save_trace
from eplb.migration import Budget, MigrationPlan
from eplb.placement import Placement
from eplb.planner_api import PlanRequest, Solution, get_planner, planner_names, register
from eplb.planning import PlanResult, plan
from eplb.policy import get_policy
from eplb.rebalance import Rebalancer, RebalanceResult
from eplb.replay import ReplayResult, Scoring, replay
from eplb.stats import LoadReport, evaluate, lower_bound
from eplb.topology import Topology
from eplb.trace import Trace

__all__ = [
    "Budget", "EplbError", "MigrationPlan", "PlanningError", "Placement", "PlanRequest", "PlanResult",
    "RebalanceResult", "Rebalancer", "ReplayResult", "Scoring", "Solution",
    "Topology", "Trace", "LoadReport", "evaluate", "get_planner", "get_policy", "load_history", "load_placement",
    "load_trace", "lower_bound", "plan", "planner_names", "register", "replay", "save_placement", "save_trace",
]
