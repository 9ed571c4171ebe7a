"""Built-in planners, one module per algorithm; importing this package registers them all."""

from planners import contiguous, greedy  # noqa: F401  (registration side effect)
from planners import deepseek  # noqa: F401
from planners import ilp  # noqa: F401
from planners import hierarchical  # noqa: F401
from planners import robust  # noqa: F401
from planners import rule_aware  # noqa: F401
