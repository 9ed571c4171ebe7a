"""What an online policy is and what it hands back: the `Policy` protocol and its `Decision`.

Legend: L = MoE layers, P = physical slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from eplb.core.placement import Placement
from eplb.migration import Budget


@dataclass(frozen=True, eq=False)
class Decision:
    """What a policy wants served next (the engine migrates to it)."""

    phy2log_LP: np.ndarray
    """The new placement's slot map, [L, P] (rows of unchanged layers equal the old ones)."""
    changed_L: np.ndarray
    """Layers whose replicas change, bool [L]."""
    gain_L: np.ndarray
    """Predicted gain per layer on the policy's own estimate (busiest / mean GPU), [L]."""
    flagged_L: np.ndarray
    """Layers the change detector flagged, bool [L]."""
    reason: str = ""


class Policy(Protocol):
    """An online rebalancing rule: windows in (after they were served), decisions out.

    `decide` honours the migration budget it is given (eplb.Budget: move caps, the price of a
    move and of spreading an expert group onto another node); a policy whose `decide` takes no
    `budget` can only be used without one. A `decide` that takes `on_draft` may call it once,
    before its last step, with the decision it would make if that step changed nothing (or
    None): the Rebalancer starts that decision's migration schedule at once and keeps it when
    the decision comes out the same.
    """

    name: str

    def observe(self, counts_LE: np.ndarray, placement: Placement) -> None:
        """Record one served window's logical counts [L, E] and the placement that served it."""

    def decide(self, placement: Placement, budget: Budget | None = None, *,
               num_expert_groups: int | None = None) -> Decision | None:
        """A new placement to migrate to from `placement` within `budget`, or None to keep it."""

    @property
    def memory_bytes(self) -> int: ...


NO_BUDGET = Budget()
"""No move cap and no price per move beyond the policy's own."""
