"""Which compiled kernels a plan or a rebalance runs, named as eplb.core.jit warm-ups.

The Rebalancer loads (after an install: compiles) them in the background at construction, the
engine integrations compile them aside while the engine starts (eplb.integrations), and the
tests load them before the first test (tests/conftest.py). One table, so that the three agree.
"""

from __future__ import annotations

import sys

from eplb.migration.schedule.rounds import RELAY_SLOTS_PER_GPU
from planners.api import planner_class

WARM_UP_MODULES = (
    "planners.greedy",          # the migration step's fallback and most policies' planner
    "eplb.migration.kernels",   # relabel, budgeted search, schedule
    "eplb.stats._score_kernel",       # the lower bound and the even-split reports of both placements
)
"""The kernel modules every Rebalancer loads (or compiles) in the background at construction
(eplb.core.jit); each defines `warm_up()`. A new numba kernel module on the decision path is
one more line here."""


RELAY_WARM_UP = "eplb.migration.kernels:warm_up_relay"
"""The schedule's relay mode, which only clusters of at most RELAY_SLOTS_PER_GPU slots per GPU
run (eplb.migration.schedule's gate), so only their Rebalancers compile it."""


def kernel_modules(planner: str, policy=None, slots_per_gpu: int | None = None) -> tuple[str, ...]:
    """The warm-ups (eplb.core.jit: "module" for module.warm_up(), or "module:function") of the
    compiled kernels a rebalance with this planner and policy (an eplb.serving.policy object, or None)
    uses: the planner's and the policy's own modules when they have one, the further modules
    the policy's settings name in `kernel_modules`, then WARM_UP_MODULES, and on clusters of at
    most RELAY_SLOTS_PER_GPU slots per GPU the schedule's relay mode (`slots_per_gpu` None: not)."""
    own = [planner_class(planner).__module__]
    if policy is not None:
        own += [type(policy).__module__, *getattr(policy, "kernel_modules", ())]
    mods = [m for m in own if callable(getattr(sys.modules.get(m), "warm_up", None))]
    relay = [] if slots_per_gpu is None or slots_per_gpu > RELAY_SLOTS_PER_GPU else [RELAY_WARM_UP]
    return tuple(dict.fromkeys(mods + list(WARM_UP_MODULES) + relay))
