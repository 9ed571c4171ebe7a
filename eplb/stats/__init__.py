"""Statistics of router traffic: windows, skew, lower bounds and scores (`loads`), memory
capacity for redundant experts (`capacity`), synthetic traffic (`synth`).

`from eplb import stats; stats.evaluate(...)` reads the names of `loads` re-exported here.
"""

from eplb.stats.loads import (
    AGGREGATIONS,
    Aggregation,
    LoadReport,
    aggregate,
    as_aggregation,
    balancedness,
    ema,
    evaluate,
    even_gpu_loads,
    even_report,
    gini,
    group_span,
    hot_ratio,
    imbalance,
    load_report,
    lower_bound,
    median,
    proven_bound,
    replica_counts_minmax,
    sliding_sum,
    window_balancedness,
)

__all__ = [
    "AGGREGATIONS",
    "Aggregation",
    "LoadReport",
    "aggregate",
    "as_aggregation",
    "balancedness",
    "ema",
    "evaluate",
    "even_gpu_loads",
    "even_report",
    "gini",
    "group_span",
    "hot_ratio",
    "imbalance",
    "load_report",
    "lower_bound",
    "median",
    "proven_bound",
    "replica_counts_minmax",
    "sliding_sum",
    "window_balancedness",
]
