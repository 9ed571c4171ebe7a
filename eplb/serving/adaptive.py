"""The default online policy, `AdaptivePolicy` ("adaptive"): a load estimate of whole windows, a
change detector, and repairs of the placement in force kept per layer where they pay.

Legend: M = windows kept in memory, H = candidate horizons, L = MoE layers, E = logical experts,
G = GPUs, S = slots per GPU, P = G x S physical slots.

How it decides is told in eplb.serving.policy's docstring (the policies' front door); the
memory length it plans on is chosen in eplb.serving.horizons, a fresh plan on a switch is
eplb.serving.replan's.
"""

from __future__ import annotations

import numpy as np

from eplb.core.placement import Placement
from eplb.core.topology import Topology
from eplb.dispatch.cost import TimeObjective, check_objective
from eplb.errors import EplbError, finite_number, positive_number, whole_number
from eplb.migration import Budget, count_moves
from eplb.migration.search import span_priced
from eplb.planning.resplit_repair import PLAN_ROUNDS
from eplb.serving.horizons import DriftTest, HorizonChooser, horizon_windows, parse_horizons
from eplb.serving.load_estimate import ChangeDetector, WindowMemory, true_or_false
from eplb.serving.policy_types import NO_BUDGET, Decision
from eplb.serving.repair import group_pairs, repair, window_imbalance, within_caps
from eplb.serving.replan import replan
from eplb.serving.resplit_decision import resplit_decision


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
    drift_horizons / drift_reference / drift_margin / drift_strong / drift_weight: with one
    horizon (no chooser), a decision first asks `DriftTest` (eplb.serving.horizons) whether the
    mean of the newest 2 or 4 windows (DRIFT, those within the memory) predicted the recent
    windows better, by more than `drift_margin`, than the mean of the newest `drift_reference`:
    traffic that drifts, or has just shifted topic. Then the newest h carry `drift_weight` of
    the planning mean (every kept window still hedged as the worst), or, where they win by more
    than `drift_strong`, are planned on alone; a move is priced `drift_move_cost` instead of
    `move_cost`. Traffic around a fixed mean (V2-Lite) never sets it off. drift_swap_price: under
    drift, the share of that price per move each of the repair's swaps must buy on its own,
    in the smooth maximum it lowers (`repair`'s swap_price; 1: a swap pays for its two moves at
    the layer's price; 0, the default: a swap need only lower it, the layer's whole change
    paying for all of its moves). Planned on the newest windows alone, a swap's drop is
    measured on two or four windows and small ones are mostly their noise; on topic shifts 1
    halves the moves for +0.3% of even-split median (docs/results/replay-history.md).
    "off" (or 0) plans on the memory always.
    rule: the dispatch rule the engine serves, "even" or "resplit" (any GPU count): a decision
    then searches the placement in force under per-batch re-split scores on the memory's
    windows and on their deviations widened `spread` times (`eplb.planning.resplit_repair`), for
    `resplit_rounds` passes, a layer changing where its gain beats `resplit_move_cost` / P per move
    (layers the change detector flagged: PLAN_ROUNDS passes at `move_cost` / P, and a fresh greedy
    plan of the memory, renamed and searched the same way, where its net gain is higher).
    objective: "tokens", or an eplb.dispatch.cost.TimeObjective: windows are then planned as each
    expert's expected seconds per step (as `eplb.plan(objective=...)` plans them).
    """

    name = "adaptive"
    RECENT = 2
    """The default horizon (windows): the newest two count again beside every kept window."""
    DRIFT = (2, 4)
    """The default short horizons of the drift test (those within the memory)."""

    def __init__(self, memory: int = 16, swaps: int = 8, urgent_swaps: int = 16, move_cost: float = 0.3,
                 detect: float = 8.0, detect_floor: float = 0.02, beta: float = 50.0, partners: int = 8,
                 replan_gap: float = 0.05, horizons: int | str | tuple | None = None, recent_weight: bool = True,
                 horizon_samples: int = 8, horizon_margin: float = 0.1, horizon_moves: float = 1.0,
                 horizon_per_layer: bool = False, drift_horizons: int | str | tuple | None = None,
                 drift_reference: int = 8, drift_margin: float = 0.05, drift_strong: float = 0.5,
                 drift_weight: float = 0.9, drift_move_cost: float = 0.2, drift_swap_price: float = 0.0,
                 rule: str = "even", spread: float = 1.5,
                 resplit_rounds: int = 1,
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
        off = (isinstance(drift_horizons, str) and drift_horizons.strip().lower() in ("", "0", "none", "off")) \
            or (np.ndim(drift_horizons) == 0 and drift_horizons == 0)
        short = tuple(h for h in self.DRIFT if h <= self.memory) if drift_horizons is None \
            else () if off else parse_horizons(drift_horizons, self.memory)
        self.drift = DriftTest(short, whole_number("drift_reference (windows)", drift_reference, 1),
                               finite_number("drift_margin", drift_margin, 0.0),
                               finite_number("drift_strong", drift_strong, 0.0),
                               finite_number("drift_weight", drift_weight, 0.0))
        self.drift_move_cost = finite_number("drift_move_cost", drift_move_cost, 0.0)
        self.drift_swap_price = finite_number("drift_swap_price", drift_swap_price, 0.0)
        self.drift_horizon: int | None = None
        """The short horizon the newest decision planned on (DriftTest), None: the whole memory."""
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

    def _windows(self, topology: Topology) -> np.ndarray:
        """The kept windows as planned on (raw, in ring order: every use sums or maximises over
        windows), [M, L, E]; planning loads are made once per window and (GPUs, nodes)."""
        n = len(self._mem)
        if self._load is None:
            return self._mem._ring_MLE[:n]
        made_for = (topology.num_gpus, topology.num_nodes)
        stale = np.flatnonzero((self._load_for[:n] != made_for).any(axis=1))
        for i in stale:
            self._load._ring_MLE[i] = self.objective.planning_load(self._mem._ring_MLE[i], topology)
            self._load_for[i] = made_for
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
            busiest_ML = window_imbalance(placement.phy2log_LP, self._windows(placement.topology), G)
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
        windows = self._windows(placement.topology)
        old_LP = placement.phy2log_LP
        flag_L = self._flag_L.copy()
        self._flag_L[:] = False
        if self.rule == "resplit":
            return self._decide_resplit(placement, windows, flag_L, budget, num_expert_groups)
        rounds_L = np.where(flag_L, self.urgent_swaps, self.swaps)
        # A layer changes only where the predicted gain pays for every replica it moves: a
        # share moves / P of the price of moving all of the layer's slots, plus the budget's.
        # A fresh plan is considered where the detector saw a shift, or everywhere while it
        # cannot tell a shift from noise (too few windows, or off). Elsewhere what keeps the
        # repair from a fresh plan is the memory's noise, which the repair hedges on purpose,
        # and the check is not free (a plan and a scoring of every window).
        # Each layer is planned on the windows of its horizon (every kept window without a chooser).
        horizon_L, win_H = self._horizon_windows(windows)
        move_cost = self.move_cost if self.drift_horizon is None else self.drift_move_cost
        price = move_cost / P + budget.move_cost
        kw = dict(beta=self.beta, partners=self.partners,
                  swap_price=0.0 if self.drift_horizon is None else self.drift_swap_price * price)
        check_L = flag_L if self.detector.kappa > 0 and len(self._mem) >= self.detector.MIN_WINDOWS \
            else np.ones_like(flag_L)
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
                args = (placement.topology, num_expert_groups, E)
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
                    new_LP[rows], cost_L2[rows], moves_LG[rows] = replan(
                        placement, old_LP[rows], win, w_M, new_LP[rows], cost_L2[rows], moves_LG[rows], price,
                        check_L[rows], self.replan_gap)
        return conclude(new_LP, cost_L2, moves_LG)

    def _decide_resplit(self, placement, windows, flag_L, budget, num_expert_groups):
        """The decision for an engine that re-splits every batch (`eplb.planning.resplit_repair`): the
        placement in force searched under re-split scores on the memory's windows (weighted as
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
        # Flagged layers are also offered a fresh plan of the memory, searched the same way.
        for rows, cost, rounds, fresh in ((np.flatnonzero(~flag_L), self.resplit_move_cost, self.resplit_rounds, False),
                                          (np.flatnonzero(flag_L), self.move_cost, PLAN_ROUNDS, True)):
            if rows.size:
                new_LP[rows], pays_L[rows], gain_L[rows] = resplit_decision(
                    old_LP[rows], win[:, rows], w_M, G, E, cost / P + budget.move_cost, (1.0, self.spread), rounds,
                    fresh)
        if not pays_L.any():
            return None
        return Decision(new_LP, pays_L, gain_L, flag_L, f"{int(pays_L.sum())} layer(s) searched for re-split")

    def _horizon_errors(self, counts_LE, placement):
        """What a decision on each horizon's windows would have served on counts_LE [L, E] (the
        repair, kept per layer where it pays for its moves): busiest / mean GPU above 1, plus
        `horizon_moves` x the decision's price of the moves it makes, [H, L]."""
        G, E, P = placement.num_gpus, placement.num_logical_experts, placement.num_slots
        n = len(self._mem)
        windows = self._windows(placement.topology)
        order = self._mem.order()
        old_LP = placement.phy2log_LP
        rounds_L = np.full(old_LP.shape[0], self.swaps)
        now = counts_LE[None] if self._load is None else \
            self.objective.planning_load(counts_LE, placement.topology)[None]
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
        order = self._mem.order()      # ring rows, oldest first
        self.drift_horizon = None
        if self._chooser is None:
            # Traffic that drifts (the newest windows predict the next better than a longer mean):
            # plan with the newest windows weighing most, or on them alone (DriftTest).
            drift = self.drift.plan_windows(windows, order)
            if drift is not None:
                self.drift_horizon = drift[0]
                return np.zeros(len(self._flag_L), dtype=np.int64), [drift[1:]]
        h_L = np.full(len(self._flag_L), self.horizons[-1]) if self._chooser is None else self._chooser.choose()
        h_L = np.minimum(h_L, n)
        used, horizon_L = np.unique(h_L, return_inverse=True)
        return horizon_L.reshape(-1), [horizon_windows(windows, order, h, self.recent_weight) for h in used]
