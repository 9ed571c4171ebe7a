"""Online rebalancing policies: the rule that decides whether a rebalance pays for its moves, on
the load estimate and change detector of eplb.serving.load_estimate and the compiled steps of eplb.serving.repair
(both re-exported here).

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
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from eplb.core.placement import Placement
from eplb.dispatch.cost import TimeObjective, check_objective
from eplb.errors import EplbError, finite_number, positive_number, whole_number
from eplb.migration import Budget, count_moves
from eplb.migration.moves import fewest_moves
from eplb.migration.search import span_priced
from eplb.planning.front_door import plan
from eplb.serving.load_estimate import (
    BucketedSum,
    ChangeDetector,
    HorizonChooser,
    WindowMemory,
    horizon_windows,
    parse_horizons,
    true_or_false,
)
from eplb.serving.repair import (
    group_pairs,
    normalise,
    renamed,
    repair,
    replica_counts,
    robust_repair,
    window_imbalance,
    within_caps,
)
from eplb.serving.resplit_repair import PLAN_ROUNDS, resplit_decision
from planners.api import get_planner
from planners.greedy import REFINE_GAP, plan_greedy, replicate

# The load estimate and the kernels' Python side live in eplb.serving.load_estimate and
# eplb.serving.repair; their names are importable from here too.
__all__ = [
    "POLICIES", "AdaptivePolicy", "BucketedSum", "ChangeDetector", "Decision", "HorizonChooser", "Policy",
    "StaticPolicy",
    "WindowMemory", "WindowPolicy", "get_policy", "group_pairs", "normalise", "policy_settings", "renamed",
    "repair", "robust_repair", "takes_budget", "window_imbalance",
]

# Decisions -------------------------------------------------------------------------------------

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


class AdaptivePolicy:
    """The default online policy (see the module docstring).

    memory: windows kept and planned against; swaps / urgent_swaps: replica swaps per layer per
    decision (urgent: layers the change detector flagged); move_cost: predicted gain (busiest /
    mean GPU, half mean and half worst window over the memory) that moving all of a layer's P
    slots must buy, so one move must buy move_cost / P; detect: change-detector threshold in
    median absolute deviations (0 = off); detect_floor: its smallest deviation; beta: sharpness
    of the smooth maximum the swaps lower; partners: GPUs (the lightest) a swap may reach;
    replan_gap: a layer whose repair stays more than this (busiest / mean GPU, on the same cost)
    above a fresh `greedy` plan of the memory's sum is offered that plan, relabelled onto the
    placement in force (a workload switch that a few swaps cannot follow); 0 = off.
    horizons: the newest windows (at most `memory`; default RECENT, 2) a decision weighs most:
    with `recent_weight` (default) it plans on every kept window and on these again, repeated
    until they weigh about as much as the older ones (the worst-window hedge still spans the
    whole memory, the mean follows drift); without it, on these windows alone; `memory` plans
    on every kept window alike. Several horizons ("2,4,8,16"): each decision takes the one
    whose decisions would have served the newest `horizon_samples` windows best
    (`HorizonChooser`: busiest / mean GPU plus `horizon_moves` x the price of their moves),
    switching only for a score lower by more than `horizon_margin` of the one in use, for the
    whole model or per layer (`horizon_per_layer`).
    rule: the dispatch rule the engine serves, "even" or "resplit" (at most 12 GPUs): a decision
    then searches the placement in force under exact per-batch re-split scores on the memory's
    windows and on their deviations widened `spread` times (`eplb.serving.resplit_repair`), for
    `resplit_rounds` passes, a layer changing where its gain beats `resplit_move_cost` / P per move
    (layers the change detector flagged: PLAN_ROUNDS passes at `move_cost` / P).
    objective: "tokens", or an eplb.dispatch.cost.TimeObjective: windows are then planned as each
    expert's expected seconds per step (as `eplb.plan(objective=...)` plans them).
    """

    name = "adaptive"
    RECENT = 2
    """The default horizon (windows): the newest two count again beside every kept window."""

    def __init__(self, memory: int = 16, swaps: int = 8, urgent_swaps: int = 16, move_cost: float = 0.3,
                 detect: float = 8.0, detect_floor: float = 0.02, beta: float = 50.0, partners: int = 8,
                 replan_gap: float = 0.05, horizons: int | str | tuple | None = None, recent_weight: bool = True,
                 horizon_samples: int = 8, horizon_margin: float = 0.1, horizon_moves: float = 1.0,
                 horizon_per_layer: bool = False, rule: str = "even", spread: float = 1.5, resplit_rounds: int = 1,
                 resplit_move_cost: float = 1.0, objective: str | TimeObjective = "tokens"):
        self.memory = whole_number("memory (windows)", memory, 1)
        self.swaps = whole_number("swaps", swaps, 0)
        self.urgent_swaps = whole_number("urgent_swaps", urgent_swaps, 0)
        self.move_cost = finite_number("move_cost", move_cost, 0.0)
        self.detector = ChangeDetector(finite_number("detect", detect, 0.0),
                                       finite_number("detect_floor", detect_floor, 0.0))
        self.beta = positive_number("beta", beta)
        self.partners = whole_number("partners", partners, 1)
        self.replan_gap = finite_number("replan_gap", replan_gap, 0.0)
        self.horizons = parse_horizons(min(self.RECENT, self.memory) if horizons is None else horizons, self.memory)
        self.recent_weight = true_or_false("recent_weight", recent_weight)
        self.horizon_moves = finite_number("horizon_moves", horizon_moves, 0.0)
        self._chooser_args = (horizon_samples, horizon_margin, horizon_per_layer)
        HorizonChooser(self.horizons, *self._chooser_args, num_layers=1)   # settings checked now
        self._chooser: HorizonChooser | None = None
        if rule not in ("even", "resplit"):
            raise EplbError(f"rule must be 'even' or 'resplit' (the dispatch rule the engine serves), got {rule!r}")
        if rule == "resplit" and len(self.horizons) > 1:
            raise EplbError(f"rule 'resplit' plans on one horizon; got horizons {self.horizons}: give one")
        self.rule = rule
        self.spread = finite_number("spread", spread, 1.0)
        self.resplit_rounds = whole_number("resplit_rounds", resplit_rounds, 1)
        self.resplit_move_cost = finite_number("resplit_move_cost", resplit_move_cost, 0.0)
        self.objective = check_objective(objective)
        self._mem: WindowMemory | None = None
        self._load: WindowMemory | None = None      # planning loads (time objective), else None
        self._load_for: np.ndarray | None = None    # (GPUs, nodes) each planning load was made for
        self._flag_L: np.ndarray | None = None

    @property
    def memory_bytes(self) -> int:
        return sum(0 if m is None else m.nbytes for m in (self._mem, self._load, self._chooser))

    def _windows(self, num_gpus: int, num_nodes: int = 1) -> np.ndarray:
        """The kept windows as planned on (raw, in ring order: every use sums or maximises over
        windows), [M, L, E]; planning loads are made once per window and (GPUs, nodes)."""
        n = len(self._mem)
        if self._load is None:
            return self._mem._ring_MLE[:n]
        stale = np.flatnonzero((self._load_for[:n] != (num_gpus, num_nodes)).any(axis=1))
        for i in stale:
            self._load._ring_MLE[i] = self.objective.planning_load(self._mem._ring_MLE[i], num_gpus, num_nodes)
            self._load_for[i] = (num_gpus, num_nodes)
        return self._load._ring_MLE[:n]

    def observe(self, counts_LE: np.ndarray, placement: Placement) -> None:
        L, E = counts_LE.shape
        G = placement.num_gpus
        if self._mem is None:
            self._mem = WindowMemory(self.memory, L, E)
            self._flag_L = np.zeros(L, dtype=bool)
            if len(self.horizons) > 1:
                self._chooser = HorizonChooser(self.horizons, *self._chooser_args, num_layers=L)
            if self.objective != "tokens":
                self._load = WindowMemory(self.memory, L, E)
                self._load_for = np.zeros((self.memory, 2), dtype=np.int64)
        if self._load_for is not None:
            self._load_for[self._mem.seen % self.memory] = 0           # its planning load is made below
        if self._chooser is not None and len(self._mem):
            # Scored on the window before it joins the memory: a prediction from the past only.
            self._chooser.record(self._horizon_errors(counts_LE, placement))
        self._mem.push(counts_LE)
        if len(self._mem) >= self.detector.MIN_WINDOWS and self.detector.kappa > 0:
            busiest_ML = window_imbalance(placement.phy2log_LP, self._windows(G, placement.num_nodes), G)
            order = self._mem.order()
            # Flags last until the next decision: windows served while a migration is in
            # flight are not lost.
            self._flag_L |= self.detector.flags(busiest_ML[order])

    def decide(self, placement: Placement, budget: Budget | None = None, *,
               num_expert_groups: int | None = None, on_draft=None) -> Decision | None:
        if self._mem is None or len(self._mem) == 0:
            return None
        budget = NO_BUDGET if budget is None else budget
        G, E, P = placement.num_gpus, placement.num_logical_experts, placement.num_slots
        windows = self._windows(G, placement.num_nodes)
        old_LP = placement.phy2log_LP
        flag_L = self._flag_L.copy()
        self._flag_L[:] = False
        if self.rule == "resplit":
            return self._decide_resplit(placement, windows, flag_L, budget, num_expert_groups)
        rounds_L = np.where(flag_L, self.urgent_swaps, self.swaps)
        kw = dict(beta=self.beta, partners=self.partners)
        # A layer changes only where the predicted gain pays for every replica it moves: a
        # share moves / P of the price of moving all of the layer's slots, plus the budget's.
        price = self.move_cost / P + budget.move_cost
        # A fresh plan is considered where the detector saw a shift, or everywhere while it
        # cannot tell a shift from noise (too few windows, or off). Elsewhere what keeps the
        # repair from a fresh plan is the memory's noise, which the repair hedges on purpose,
        # and the check is not free (a plan and a scoring of every window).
        check_L = flag_L if self.detector.kappa > 0 and len(self._mem) >= self.detector.MIN_WINDOWS \
            else np.ones_like(flag_L)
        # Each layer is planned on the windows of its horizon (every kept window without a chooser).
        horizon_L, win_H = self._horizon_windows(windows)
        parts = [(slice(None), *win_H[0])]
        if len(win_H) > 1:
            parts = [(rows, win[:, rows], w_M) for h, (win, w_M) in enumerate(win_H)
                     for rows in [np.flatnonzero(horizon_L == h)]]
        new_LP, cost_L2 = np.empty_like(old_LP), np.empty((len(old_LP), 2))
        moves_LG = np.empty((len(old_LP), G), dtype=np.int64)
        for rows, win, w_M in parts:
            new_LP[rows], cost_L2[rows] = repair(old_LP[rows], win, G, rounds_L=rounds_L[rows], weights_M=w_M, **kw)
            moves_LG[rows] = count_moves(old_LP[rows], new_LP[rows], G, E)
        span = span_priced(placement.num_nodes, num_expert_groups, budget)
        capped = budget.max_moves is not None or budget.max_moves_per_gpu is not None

        def price_L(rows_LP, moves_L, layers):
            out = price * moves_L
            if span:
                args = (G, placement.num_nodes, num_expert_groups, E)
                added = group_pairs(rows_LP, *args) - group_pairs(old_LP[layers], *args)
                out = out + price * budget.span_cost * added
            return out

        def conclude(new_LP, cost_L2, moves_LG):
            layers = np.arange(len(old_LP))
            gain_L = cost_L2[:, 0] - cost_L2[:, 1]
            moves_L = moves_LG.sum(axis=1)
            pays_L = (moves_L > 0) & (gain_L > price_L(new_LP, moves_L, layers))
            if capped:
                pays_L, new_LP, gain_L = within_caps(old_LP, [win_H[h] for h in horizon_L], G, E, budget, rounds_L,
                                                     pays_L, new_LP, gain_L, moves_LG, price_L, kw)
            if not pays_L.any():
                return None
            why = f"{int(pays_L.sum())} layer(s) repaired ({int(flag_L.sum())} flagged by the change detector)"
            return Decision(np.where(pays_L[:, None], new_LP, old_LP), pays_L, np.where(pays_L, gain_L, 0.0),
                            flag_L.copy(), why)

        if self.replan_gap > 0 and check_L.any():
            # The repair's decision is the decision unless a fresh plan replaces a layer's repair,
            # which on drifting traffic it rarely does: handed out as a draft first (without move
            # caps, whose fitting repairs again), its migration can be scheduled meanwhile.
            if on_draft is not None and not capped:
                on_draft(conclude(new_LP, cost_L2, moves_LG))
            for rows, win, w_M in parts:
                if check_L[rows].any():
                    new_LP[rows], cost_L2[rows], moves_LG[rows] = self._replan(
                        placement, old_LP[rows], win, w_M, new_LP[rows], cost_L2[rows], moves_LG[rows], price,
                        check_L[rows])
        return conclude(new_LP, cost_L2, moves_LG)

    def _decide_resplit(self, placement, windows, flag_L, budget, num_expert_groups):
        """The decision for an engine that re-splits every batch (`eplb.serving.resplit_repair`): the
        placement in force searched under exact re-split scores on the memory's windows (weighted as
        the even rule's are) and their widened deviations, kept per layer where it pays."""
        if budget.max_moves is not None or budget.max_moves_per_gpu is not None \
                or span_priced(placement.num_nodes, num_expert_groups, budget):
            raise EplbError("rule 'resplit' decides without move caps or a span price; drop max_moves, "
                            "max_moves_per_gpu and span_cost from the budget, or use rule 'even'")
        G, E, P = placement.num_gpus, placement.num_logical_experts, placement.num_slots
        win, w_M = horizon_windows(windows, self._mem.order(), self.horizons[-1], self.recent_weight)
        old_LP = placement.phy2log_LP
        new_LP, pays_L, gain_L = old_LP.copy(), np.zeros(len(old_LP), dtype=bool), np.zeros(len(old_LP))
        # Layers the change detector flagged met traffic their placement was not made for: they are
        # searched longer and at the even rule's price, as the even rule gives them urgent swaps.
        for rows, cost, rounds in ((np.flatnonzero(~flag_L), self.resplit_move_cost, self.resplit_rounds),
                                   (np.flatnonzero(flag_L), self.move_cost, PLAN_ROUNDS)):
            if rows.size:
                new_LP[rows], pays_L[rows], gain_L[rows] = resplit_decision(
                    old_LP[rows], win[:, rows], w_M, G, E, cost / P + budget.move_cost, (1.0, self.spread), rounds)
        if not pays_L.any():
            return None
        return Decision(new_LP, pays_L, gain_L, flag_L, f"{int(pays_L.sum())} layer(s) searched for re-split")

    def _horizon_errors(self, counts_LE, placement):
        """What a decision on each horizon's windows would have served on counts_LE [L, E] (the
        repair, kept per layer where it pays for its moves): busiest / mean GPU above 1, plus
        `horizon_moves` x the decision's price of the moves it makes, [H, L]."""
        G, E, P = placement.num_gpus, placement.num_logical_experts, placement.num_slots
        n = len(self._mem)
        windows = self._windows(G, placement.num_nodes)
        order = self._mem.order()
        old_LP = placement.phy2log_LP
        rounds_L = np.full(old_LP.shape[0], self.swaps)
        now = counts_LE[None] if self._load is None else \
            self.objective.planning_load(counts_LE, G, placement.num_nodes)[None]
        out = {}
        for h in sorted({min(int(h), n) for h in self.horizons}):
            win, w_M = horizon_windows(windows, order, h, self.recent_weight)
            new_LP, cost_L2 = repair(old_LP, win, G, rounds_L=rounds_L, beta=self.beta, partners=self.partners,
                                     weights_M=w_M)
            moves_L = count_moves(old_LP, new_LP, G, E).sum(axis=1)
            pays_L = (moves_L > 0) & (cost_L2[:, 0] - cost_L2[:, 1] > self.move_cost / P * moves_L)
            busiest_L = window_imbalance(np.where(pays_L[:, None], new_LP, old_LP), now, G)[0]
            out[h] = busiest_L - 1.0 + self.horizon_moves * self.move_cost / P * np.where(pays_L, moves_L, 0)
        return np.stack([out[min(int(h), n)] for h in self.horizons])

    def _horizon_windows(self, windows):
        """(horizon_L, win_H): which horizon each layer is planned on, int [L], and for each horizon
        in use its windows and their weights, ([M_h, L, E], [M_h]) (`horizon_windows`)."""
        n = len(self._mem)
        h_L = np.full(len(self._flag_L), self.horizons[-1]) if self._chooser is None else self._chooser.choose()
        h_L = np.minimum(h_L, n)
        used, horizon_L = np.unique(h_L, return_inverse=True)
        order = self._mem.order()      # ring rows, oldest first
        return horizon_L.reshape(-1), [horizon_windows(windows, order, h, self.recent_weight) for h in used]

    def _replan(self, placement, old_LP, windows, w_M, new_LP, cost_L2, moves_LG, price, check_L):
        """Offer a fresh greedy plan of the windows' (weighted) sum to the layers of check_L the
        repair leaves far (> replan_gap) above it; it replaces the repair where its net gain (gain -
        price x moves) is higher. old_LP: the layers' rows in force, [n, P]; windows [M, n, E],
        weighted w_M [M]. Returns (new_LP, cost_L2, moves_LG), changed rows only."""
        G, E, P = placement.num_gpus, placement.num_logical_experts, placement.num_slots
        total_LE = (windows * w_M[:, None, None]).sum(axis=0)
        # Greedy's replica counts bound its plan from below, before it is made: in each window
        # the busiest GPU holds at least the mean load and each expert's share per replica, and
        # each replica an expert gains lands on a GPU that did not hold it (a move). Only the
        # layers where the plan could still be far from the repair and pay for its moves are
        # planned.
        count_LE = replicate(total_LE, P, G)
        per_ML = np.maximum(1.0, (normalise(windows, G) / count_LE).max(axis=2))
        bound_L = 0.5 * np.average(per_ML, axis=0, weights=w_M) + 0.5 * per_ML.max(axis=0)
        net_rep_L = cost_L2[:, 0] - cost_L2[:, 1] - price * moves_LG.sum(axis=1)
        gained_L = np.maximum(count_LE - replica_counts(old_LP, E), 0).sum(axis=1)
        cand = np.flatnonzero(check_L & (bound_L < cost_L2[:, 1] - self.replan_gap)
                              & (cost_L2[:, 0] - bound_L - price * gained_L > np.maximum(net_rep_L, 0.0)))
        if not cand.size:
            return new_LP, cost_L2, moves_LG
        fresh_LP, cost_L = self._fresh(placement, windows, w_M, total_LE, count_LE, cand)
        # The same test with the plan's own cost in place of the bound on it, and its moves bounded
        # by what any renaming could keep (`fewest_moves`; at least every replica gained, as
        # greedy never puts two replicas of an expert on one GPU): the renaming is made only where
        # the plan can still pay.
        moves_lb = np.maximum(gained_L[cand], fewest_moves(old_LP[cand], fresh_LP, G, E))
        far = (cost_L < cost_L2[cand, 1] - self.replan_gap) \
            & (cost_L2[cand, 0] - cost_L - price * moves_lb > np.maximum(net_rep_L[cand], 0.0))
        cand, fresh_LP, cost_L = cand[far], fresh_LP[far], cost_L[far]
        if not cand.size:
            return new_LP, cost_L2, moves_LG
        rows_LP = renamed(old_LP[cand], fresh_LP, G, E, placement.num_nodes)
        rows_LG = count_moves(old_LP[cand], rows_LP, G, E)
        take = cost_L2[cand, 0] - cost_L - price * rows_LG.sum(axis=1) > np.maximum(net_rep_L[cand], 0.0)
        if not take.any():
            return new_LP, cost_L2, moves_LG
        new_LP, cost_L2, moves_LG = new_LP.copy(), cost_L2.copy(), moves_LG.copy()
        layers = cand[take]
        new_LP[layers] = rows_LP[take]
        cost_L2[layers, 1] = cost_L[take]
        moves_LG[layers] = rows_LG[take]
        return new_LP, cost_L2, moves_LG

    @staticmethod
    def _fresh(placement, windows, w_M, total_LE, count_LE, layers):
        """A greedy plan of the windows' sum for `layers`, [n, P], and its cost on the windows
        (half the mean, weighted w_M, half the worst window of busiest / mean GPU), [n]. count_LE:
        greedy's replica counts of the sum (`replicate`, per layer), which the bound was made from."""
        fresh_LP = plan_greedy(total_LE[layers], placement.num_gpus, placement.slots_per_gpu,
                               count_LE=count_LE[layers], refine_gap=REFINE_GAP)
        busiest_ML = window_imbalance(fresh_LP, windows[:, layers], placement.num_gpus)
        return fresh_LP, 0.5 * np.average(busiest_ML, axis=0, weights=w_M) + 0.5 * busiest_ML.max(axis=0)


class WindowPolicy:
    """Plan on the sum of the newest `window` windows (None: every window seen) at each decision.

    planner: an eplb planner name; move_cost: the migration-aware plan's price per move
    (eplb.migration.Budget), 0.001 as the Rebalancer's default, added to a budget's own;
    objective: "tokens" or an eplb.dispatch.cost.TimeObjective, handed to `eplb.plan`.
    """

    name = "window"

    def __init__(self, window: int | None = 8, planner: str = "greedy", move_cost: float = 0.001,
                 objective: str | TimeObjective = "tokens"):
        if isinstance(window, str) and window.lower() in ("all", "none"):
            window = None
        self.window = None if window is None else whole_number("window (windows)", window, 1)
        get_planner(planner)
        self.planner = planner
        self.move_cost = finite_number("move_cost", move_cost, 0.0)
        self.objective = check_objective(objective)
        self._mem: WindowMemory | None = None
        self._total_LE: np.ndarray | None = None

    @property
    def memory_bytes(self) -> int:
        return (0 if self._mem is None else self._mem.nbytes) + (0 if self._total_LE is None else self._total_LE.nbytes)

    def observe(self, counts_LE: np.ndarray, placement: Placement) -> None:
        if self.window is None:
            self._total_LE = counts_LE.astype(np.float64) if self._total_LE is None else self._total_LE + counts_LE
            return
        if self._mem is None:
            self._mem = WindowMemory(self.window, *counts_LE.shape)
        self._mem.push(counts_LE)

    def decide(self, placement: Placement, budget: Budget | None = None, *,
               num_expert_groups: int | None = None) -> Decision | None:
        load_LE = self._total_LE if self.window is None else (None if self._mem is None else self._mem.total())
        if load_LE is None or load_LE.sum() <= 0:
            return None
        budget = NO_BUDGET if budget is None else budget
        # The planner's map only: PlanResult.placement would also score a contiguous baseline.
        res = plan(load_LE, topology=placement.topology, planner=self.planner, previous=placement,
                   budget=replace(budget, move_cost=budget.move_cost + self.move_cost),
                   num_expert_groups=num_expert_groups, objective=self.objective)
        new_LP = res.solution.phy2log_LP
        changed_L = (new_LP != placement.phy2log_LP).any(axis=1)
        if not changed_L.any():
            return None
        L = new_LP.shape[0]
        return Decision(new_LP, changed_L, np.zeros(L), np.zeros(L, dtype=bool),
                        f"{self.planner} on the last {self.window or 'all'} window(s)")


class StaticPolicy:
    """Never rebalance: the placement made before serving stays (the reference a policy must beat)."""

    name = "static"
    memory_bytes = 0

    def observe(self, counts_LE: np.ndarray, placement: Placement) -> None:
        return None

    def decide(self, placement: Placement, budget: Budget | None = None, *,
               num_expert_groups: int | None = None) -> Decision | None:
        return None


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
