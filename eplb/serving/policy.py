"""Online rebalancing policies, their front door: the registry (`POLICIES`, `get_policy`) and every
policy's public name, re-exported from the modules that hold them: `Policy` and `Decision`
(eplb.serving.policy_types), `AdaptivePolicy` (eplb.serving.adaptive; its horizons in
eplb.serving.horizons, its replan in eplb.serving.replan), `WindowPolicy` and `StaticPolicy`
(eplb.serving.window_policies), the load estimate and change detector
(eplb.serving.load_estimate) and the compiled steps' Python side (eplb.serving.repair).

Legend: M = windows kept in memory, B = buckets of a sliding sum, L = MoE layers, E = logical
experts, G = GPUs, S = slots per GPU, P = G x S physical slots.

A policy sees the traffic one *window* at a time (a batch of steps: `eplb replay` cuts a trace
into windows; the `Rebalancer` closes one every `interval` observations), always after the
window was served, and is asked for a `Decision` only between windows. It never sees a
window before it is served.

The default, `AdaptivePolicy` ("adaptive"):
- Load estimate: the newest `memory` windows, each kept whole (a bounded ring, `WindowMemory`).
  Planning is robust against every one of them (as the `robust` planner is), not against their
  sum, so regimes that alternate (prefill / decode) are hedged rather than chased; the newest
  `horizons` windows (2) count again until they weigh about as much as the older ones, so the
  mean follows drift while the worst-window hedge spans the whole memory. Given several
  horizons, `HorizonChooser` picks the one whose decisions served the newest windows best.
- Change detector (`ChangeDetector`): the placement in force is scored on the window it just
  served; a layer whose busiest / mean GPU is far above what the same placement does on the
  windows before it (median + `detect` median absolute deviations) has met traffic its
  placement was not made for: a real shift, not noise of the usual size.
- Decision: a *repair* of the placement in force (`robust_repair`: replica counts moved
  towards what the memory needs, then at most `swaps` replica swaps per layer, `urgent_swaps`
  for layers the detector flagged) is kept per layer only where its predicted gain on the
  same memory pays for its moves: gain (half the mean, half the worst window of busiest /
  mean, in units of the layer's mean GPU load) > `move_cost` x moves. Layers that do not
  pay keep their replicas, so steady traffic costs no moves at all.
- Replan on a switch: where the detector flagged a layer (or cannot judge yet: fewer than 4
  windows), a fresh `greedy` plan of the memory's sum, renamed onto the placement in force
  (`renamed`), replaces the repair if the repair stays more than `replan_gap` above it and the
  plan's gain net of its moves' price is higher: a few swaps follow drift, not a new workload.
  Bounds cut the work without changing the answer: the plan is made only where its replica
  counts' bound could still win, and renamed only where the most any renaming could keep in
  place (`fewest_moves`) leaves its moves affordable (on drifting traffic a fresh plan rarely is).

`WindowPolicy` ("window") is the fixed-horizon rule the `Rebalancer` implements with
`window=N`: plan on the sum of the newest N windows (all when None) with a planner, migration
aware (`eplb.plan(previous=...)`, move_cost 0.001), at every decision. `StaticPolicy`
("static") never rebalances. `get_policy` builds any of them by name with settings checked.
"""

from __future__ import annotations

import inspect

from eplb.dispatch.cost import TimeObjective, check_objective
from eplb.errors import EplbError, settings_map
from eplb.serving.adaptive import AdaptivePolicy
from eplb.serving.horizons import HorizonChooser, horizon_windows, parse_horizons
from eplb.serving.load_estimate import BucketedSum, ChangeDetector, WindowMemory, true_or_false
from eplb.serving.policy_types import NO_BUDGET, Decision, Policy
from eplb.serving.repair import (
    group_pairs,
    normalise,
    renamed,
    repair,
    robust_repair,
    window_imbalance,
)
from eplb.serving.window_policies import StaticPolicy, WindowPolicy

# The policies, the load estimate and the kernels' Python side live in the modules above; their
# names are importable from here too.
__all__ = [
    "NO_BUDGET", "POLICIES", "AdaptivePolicy", "BucketedSum", "ChangeDetector", "Decision", "HorizonChooser",
    "Policy", "StaticPolicy", "WindowMemory", "WindowPolicy", "get_policy", "group_pairs", "horizon_windows",
    "normalise", "parse_horizons", "policy_settings", "renamed", "repair", "robust_repair", "takes_budget",
    "true_or_false", "window_imbalance",
]

POLICIES: dict[str, type] = {"adaptive": AdaptivePolicy, "window": WindowPolicy, "static": StaticPolicy}
"""Policies by name; "adaptive" is the default of `eplb replay` and the `Rebalancer`."""

_NOT_SETTINGS = ("self", "objective")   # given whole (get_policy(objective=...)), not as --set text


def policy_settings(name: str) -> list[str]:
    """The settings a policy takes (its constructor's keywords, the objective aside)."""
    if name not in POLICIES:
        raise EplbError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")
    return [k for k in inspect.signature(POLICIES[name]).parameters if k not in _NOT_SETTINGS]


def get_policy(policy: str | Policy = "adaptive", settings: dict | None = None,
               objective: str | TimeObjective = "tokens") -> Policy:
    """A fresh policy by name with settings checked, or a policy object as it is (no settings).

    objective: "tokens" or an eplb.dispatch.cost.TimeObjective for the policies that plan (adaptive,
    window); a policy object must have been built with it (its `objective` attribute).
    """
    objective = check_objective(objective)
    settings = settings_map("policy settings", settings)
    if not isinstance(policy, str):
        if settings:
            raise EplbError(f"settings {sorted(settings)} apply to a policy given by name, not to a "
                            f"{type(policy).__name__} object: set them on the object")
        missing = [m for m in ("observe", "decide") if not callable(getattr(policy, m, None))]
        if missing:
            raise EplbError(f"policy must be a name ({', '.join(POLICIES)}) or have observe() and decide(); "
                            f"{type(policy).__name__} lacks {', '.join(missing)}")
        if objective != "tokens" and getattr(policy, "objective", "tokens") != objective:
            raise EplbError(f"objective {objective.name!r} applies to a policy given by name; this "
                            f"{type(policy).__name__} object was not built with it: build it with objective=...")
        return policy
    known = policy_settings(policy)
    unknown = sorted(set(settings or {}) - set(known))
    if unknown:
        raise EplbError(f"policy {policy!r} has no setting {', '.join(map(repr, unknown))}; "
                        f"its settings are {', '.join(known) or 'none'}")
    extra = {} if objective == "tokens" or "objective" not in inspect.signature(POLICIES[policy]).parameters \
        else {"objective": objective}
    return POLICIES[policy](**(settings or {}), **extra)


def takes_budget(policy: Policy) -> bool:
    """Does the policy's `decide` take a `budget` (the Rebalancer refuses limits it would ignore)?"""
    try:
        return "budget" in inspect.signature(policy.decide).parameters
    except (TypeError, ValueError):
        return False
