"""How an engine splits each expert's tokens among its replicas, and what a step costs.

- `rules`: the dispatch rules (even, the plan's weights, per-batch re-split, the exact LP) and
  the engine table (`ENGINES`, `engine_rule`, `get_rule`), re-exported here;
- `sglang`: SGLang's static and dynamic rules, modelled from its source;
- `cost`: the hardware cost model (`CostModel`, `step_cost`, `TimeObjective`);
- `timed`: the per-batch dispatch for modeled time (`TimeDispatch`);
- `calibration`: fitting a hardware profile to the runtime shim's measurements.
"""

from eplb.dispatch.rules import (
    ENGINES,
    RULES,
    DispatchRule,
    EvenSplit,
    OptimalSplit,
    PlanWeights,
    Resplit,
    Resplitter,
    engine_rule,
    get_rule,
    max_gpu_load,
    optimal_weights,
    resplit,
    rule_gpu_loads,
)

__all__ = [
    "DispatchRule",
    "ENGINES",
    "EvenSplit",
    "OptimalSplit",
    "PlanWeights",
    "RULES",
    "Resplit",
    "Resplitter",
    "engine_rule",
    "get_rule",
    "max_gpu_load",
    "optimal_weights",
    "resplit",
    "rule_gpu_loads",
]
