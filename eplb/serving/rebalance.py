"""Rebalancer: the hook a serving loop calls to keep its expert placement balanced.

Legend: L = MoE layers, E = logical experts, G = GPUs (ranks), S = slots per GPU,
P = G x S physical slots.

Usage (pure numpy; no torch):

    rb = Rebalancer(placement, interval=1000)  # the adaptive online policy (eplb.serving.policy)
    for step in serving_loop:
        if rb.observe(counts_LE):              # or physical-slot counts [L, P]
            result = rb.rebalance()            # may run on a side thread
            engine.migrate(result.migration)   # rounds of copies, see eplb.migration
    rb.rebalance(failed_ranks=[5])             # a rank died: plan on the others

`observe` only accumulates (a few tens of microseconds at DeepSeek-V3 shape). By default
(`policy="adaptive"`, or any eplb.serving.policy name or object) every `interval` observations form
one window handed to the policy, every window is due, and `rebalance` asks the policy, which
repairs the placement in force where the gain pays for the moves, within the budget, or keeps
it (a result without moves). With `policy=None` the improvement rule applies instead: every `interval`
observations the improvement a rebalance could bring (the current placement's busiest-GPU load
against the lower bound, summed over layers) is checked against `min_improvement`, and
`rebalance` plans a migration-aware placement through `eplb.plan` (move budget / move cost).
Either way the copies are scheduled safely and the new placement adopted. A rebalance after
failed ranks always plans through `eplb.plan` on the surviving ranks.
All state is guarded by one lock; planning runs outside it, so `observe` is never blocked
for long by a rebalance on another thread.
"""

from __future__ import annotations

import collections
import inspect
import threading
import time
from dataclasses import replace

import numpy as np

from eplb.core.jit import record
from eplb.core.placement import Placement
from eplb.core.trace import MAX_COUNT
from eplb.dispatch.cost import TimeObjective, check_objective
from eplb.dispatch.rules import DispatchRule, get_rule
from eplb.errors import EplbError, fraction, is_number, is_whole, number_array, shown, whole_number
from eplb.migration import Budget, layout_dependent
from eplb.migration.search import span_priced
from eplb.planning.front_door import lower_bound
from eplb.serving import decisions
from eplb.serving.decisions import RebalanceResult, Served
from eplb.serving.load_estimate import BucketedSum
from eplb.serving.policy import Policy, get_policy, takes_budget
from planners.api import get_planner

DEFAULT_BUDGET = Budget(move_cost=0.001)
"""The budget of `eplb.plan` when the Rebalancer is given none (failed ranks, policy=None): no
move limit, each move must buy 0.1% of a layer's mean GPU load (so a rebalance never copies
experts for a negligible gain). A policy given no budget prices its moves itself."""

DEFAULT_MIN_IMPROVEMENT = 0.02
"""policy=None's threshold when none is given."""


class Rebalancer:
    """Observe router counts, decide when to rebalance, plan and schedule the migration.

    placement: what the engine serves now.
    window: keep the newest `window` observations (sliding sum, in at most 64 bucket sums:
      exact up to 64, bounded memory beyond, see eplb.serving.load_estimate.BucketedSum); alpha: exponential
      moving average with this weight on each new observation; neither: sum of everything
      observed. This load is what failed-rank plans (and, with policy=None, every plan) use.
    policy: the online policy (eplb.serving.policy name or object) that decides rebalances from windows
      of `interval` observations; None: the min_improvement rule below. Default "auto": the
      "adaptive" policy, or None when min_improvement is given or under a dispatch rule that
      splits by the layout (SGLang static), whose plans the adaptive repair (which prices an
      even split) cannot judge.
    interval: observations per window (a policy), or between checks (policy=None).
    min_improvement: policy=None only (refused with a policy, which decides by its own gain
      and move price): rebalance when the predicted cut in the summed busiest-GPU load
      (1 - lower bound / current) is at least this (0 = rebalance at every check; default 0.02).
    planner, settings: the planner `eplb.plan` runs (from-scratch target) for failed ranks and
      with policy=None.
    budget: migration budget per rebalance (eplb.Budget: max_moves, max_moves_per_gpu,
      move_cost, span_cost, bytes_per_expert). A policy decides within it: at most max_moves
      (and max_moves_per_gpu onto any GPU), each move paying budget.move_cost on top of the
      policy's own price, each (group, node) pair it adds priced span_cost moves. Plans through
      `eplb.plan` use it too; when none is given they use `DEFAULT_BUDGET` (move_cost=0.001:
      each copied expert must buy at least 0.1% of a layer's mean GPU load) and a policy its own
      price alone. bytes_per_expert gives the migration's byte counts.
    layers_per_chunk: rounds of the migration only mix layers of one chunk.
    num_expert_groups: expert groups of the router (DeepSeek-V3: 8), for node-aware planners and, on
      placements over several nodes, for the budget's span_cost: spreading a group onto one more
      node costs that many moves, which keeps a node-aware plan's locality.
    objective: "tokens", or an `eplb.dispatch.cost.TimeObjective`: the policy plans each window as the
      experts' expected seconds per step, and `eplb.plan` gets it too (policy=None's decision
      to rebalance still compares token loads with their lower bound).
    dispatch: the rule the engine splits tokens by (a name or an eplb.dispatch rule, default
      "plan"): handed to `eplb.plan` (planning and the migration step judge plans under it,
      and its default planner is then "rule-aware" for SGLang's rules); the current placement's
      load in the decision and `before` / `after` are scored under it too.
    """

    def __init__(self, placement: Placement, *, window: int | None = None, alpha: float | None = None,
                 interval: int = 1000, min_improvement: float | None = None, planner: str | None = None,
                 settings: dict | None = None, budget: Budget | None = None,
                 layers_per_chunk: int | None = None, num_expert_groups: int | None = None,
                 objective: str | TimeObjective = "tokens", policy: str | Policy | None = "auto",
                 dispatch: str | DispatchRule | None = None):
        if not isinstance(placement, Placement) or placement.partial:
            what = "a partial Placement" if isinstance(placement, Placement) else type(placement).__name__
            raise EplbError(f"Rebalancer needs a Placement (the one the engine serves), got {what}")
        if window is not None and alpha is not None:
            raise EplbError(f"give either window ({window}) or alpha ({alpha}), not both")
        self.window = None if window is None else whole_number("window (observations)", window, 1)
        self.alpha = None if alpha is None else fraction("alpha", alpha)
        self.interval = whole_number("interval (observations)", interval, 1)
        self.dispatch = get_rule("plan" if dispatch is None else dispatch)
        if isinstance(policy, str) and policy == "auto":
            # The adaptive repair prices replicas as an even split; under a rule that splits by
            # the layout (SGLang static) the rebalance plans and migrates under the rule instead.
            # A min_improvement asks for the rule of policy=None.
            policy = None if layout_dependent(self.dispatch) or min_improvement is not None else "adaptive"
        if policy is not None and min_improvement is not None:
            raise EplbError(f"min_improvement ({min_improvement}) is the rule of policy=None; policy "
                            f"{getattr(policy, 'name', policy)!r} decides by its predicted gain and move price: "
                            f"drop min_improvement, or pass policy=None to use it")
        self.min_improvement = fraction("min_improvement", DEFAULT_MIN_IMPROVEMENT if min_improvement is None
                                        else min_improvement, low_open=False, high_open=True)
        # Used only once a rebalance has planned: checked now, not after the planning.
        self.layers_per_chunk = None if layers_per_chunk is None else whole_number("layers_per_chunk",
                                                                                   layers_per_chunk, 1)
        if budget is not None and not isinstance(budget, Budget):
            raise EplbError(f"budget must be an eplb.Budget (max_moves, max_moves_per_gpu, move_cost, span_cost, "
                            f"bytes_per_expert), got {type(budget).__name__}")
        self.budget = DEFAULT_BUDGET if budget is None else budget
        self._policy_budget = budget
        E = placement.num_logical_experts
        if num_expert_groups is not None and (not is_whole(num_expert_groups) or num_expert_groups < 1
                                              or E % num_expert_groups):
            raise EplbError(f"num_expert_groups must divide the {E} experts, got {num_expert_groups!r}")
        self.num_expert_groups = None if num_expert_groups is None else int(num_expert_groups)
        if policy is not None and layout_dependent(self.dispatch):
            raise EplbError(f"policy {getattr(policy, 'name', policy)!r} decides for an even split, but dispatch "
                            f"{self.dispatch.name!r} splits by the layout: leave policy out (the rebalance "
                            f"then plans and migrates under the rule)")
        if planner is None:
            planner = "rule-aware" if layout_dependent(self.dispatch) else "greedy"
        get_planner(planner, **(settings or {}))          # fail now on a bad name or setting
        self.objective = check_objective(objective)
        self.planner = planner
        self.settings = dict(settings or {})
        self.policy = None if policy is None else get_policy(policy, objective=self.objective)
        if self.policy is not None:
            self._check_policy_budget(placement)
            params = inspect.signature(self.policy.decide).parameters if takes_budget(self.policy) else {}
            self._decide_kw = {k: v for k, v in (("budget", self._policy_budget),
                                                 ("num_expert_groups", self.num_expert_groups)) if k in params}
            self._takes_draft = "on_draft" in params
        # Windows closed by observe wait here for the policy, which sees them on the rebalancing
        # thread (under its own lock), so observe never waits for a decision in progress.
        self._closed: collections.deque = collections.deque(maxlen=64)
        self._policy_lock = threading.Lock()
        self._lock = threading.Lock()
        self._version = 0
        self._load_LE = None
        self._adopt(placement, np.arange(placement.num_gpus), self.dispatch.bind(placement))
        self.step = 0
        self.last_check: dict = {}

    def _check_policy_budget(self, placement: Placement) -> None:
        """Refuse a budget the policy object cannot honour (its decide takes none)."""
        b = self._policy_budget
        if b is None or takes_budget(self.policy):
            return
        span = span_priced(placement.num_nodes, self.num_expert_groups, b)
        if b.limited or span:
            raise EplbError(f"policy {type(self.policy).__name__} decides without a budget (its decide() takes no "
                            f"budget), so {b} would be ignored: give decide a budget parameter, or drop the "
                            f"budget's move limits")

    # State ------------------------------------------------------------------------------------

    def _adopt(self, placement: Placement, rank_ids: np.ndarray, bound) -> None:
        """Switch to a new placement, `bound` the dispatch rule bound to it (lock held or during
        construction).

        The window holds logical loads, which do not depend on the placement, so it is kept
        (a rank failing right after a rebalance still plans on recent traffic); only the
        count towards the next check restarts.
        """
        L, E = placement.num_layers, placement.num_logical_experts
        self.placement = placement
        self._bound = bound
        self.rank_ids = np.asarray(rank_ids, dtype=np.int64)
        self._flat_LP = placement.phy2log_LP + (np.arange(L) * E)[:, None]
        if getattr(self, "_load_LE", None) is None:
            self._sliding = BucketedSum(self.window, L, E) if self.window else None
            self._load_LE = self._sliding.sum_LE if self._sliding is not None else np.zeros((L, E))
            self._window_LE = np.zeros((L, E))
            self._window_obs = 0
            self._seen = 0
        self._since_check = 0
        self._version += 1

    @property
    def load_LE(self) -> np.ndarray:
        """The load the next rebalance plans on (copy), float64 [L, E]."""
        with self._lock:
            return self._load_snapshot()

    def _load_snapshot(self) -> np.ndarray:
        """Copy of the window load (lock held). A sliding sum of float counts leaves rounding
        residue (-1e-16 where the window holds only zeros), which planners refuse as negative:
        it is cut at 0 here rather than in `observe`, which runs every step."""
        return np.maximum(self._load_LE, 0.0)

    # Observe / decide -------------------------------------------------------------------------

    def observe(self, counts, *, physical: bool | None = None) -> bool:
        """Add one step's (or batch's) router counts; True when a rebalance is due.

        counts: logical [L, E], or physical-slot [L, P] (mapped back through the current
        placement). When E == P the shape does not say which: pass `physical`.
        """
        if physical is not None and not isinstance(physical, (bool, np.bool_)):
            raise EplbError(f"physical must be True, False or None, got {shown(physical)}")
        c = self._checked_counts(counts)
        with self._lock:
            pl = self.placement
            L, E, P = pl.num_layers, pl.num_logical_experts, pl.num_slots
            if c.ndim != 2 or c.shape[0] != L or c.shape[1] not in (E, P):
                raise EplbError(f"counts have shape {c.shape}; expected logical [{L}, {E}] or "
                                f"physical-slot [{L}, {P}] for the current placement")
            if physical is None:
                if E == P:
                    raise EplbError(f"counts [{L}, {E}] could be logical or physical ({E} experts = "
                                    f"{P} slots): pass physical=True or physical=False")
                physical = c.shape[1] == P
            if physical:
                if c.shape[1] != P:
                    raise EplbError(f"physical counts must be [{L}, {P}], got {c.shape}")
                c = np.bincount(self._flat_LP.ravel(), weights=c.ravel(), minlength=L * E).reshape(L, E)
            elif c.shape[1] != E:
                raise EplbError(f"logical counts must be [{L}, {E}], got {c.shape}")
            if self.alpha is not None:
                if self._seen == 0:
                    self._load_LE[:] = c
                else:
                    self._load_LE *= 1.0 - self.alpha
                    self._load_LE += self.alpha * c
            elif self._sliding is not None:
                self._sliding.add(c)
            else:
                self._load_LE += c
            self._seen += 1
            self.step += 1
            self._since_check += 1
            if self.policy is not None:
                self._window_LE += c
                self._window_obs += 1
            if self._since_check < self.interval:
                return False
            self._since_check = 0
            if self.policy is not None:
                self._closed.append((self._window_LE.copy(), pl))
                self._window_LE[:] = 0.0
                self._window_obs = 0
                self.last_check = {"step": self.step, "due": True,
                                   "reason": f"window closed for policy {self.policy.name}"}
                due = True
            else:
                due = self._check_locked()
        return due

    def _checked_counts(self, counts) -> np.ndarray:
        """One observation as float64, refused (state unchanged) unless it is real token counts.

        Checked before the window changes: one NaN or 1e308 would stay in a sliding sum for
        good. An observation may hold at most 2**62 / window token-slots, so no window of them
        exceeds 2**62, the bound plan() puts on loads (complex, bool and text are refused too:
        numpy would drop the imaginary part or read True as 1)."""
        try:  # number_array takes torch tensors too (bfloat16 ones as float64; meta and sparse refused)
            c = number_array("counts", counts).astype(np.float64)
        except EplbError as exc:
            raise EplbError(f"{exc} (tokens routed to each expert or slot); the window is unchanged") from None
        if not np.isfinite(c).all() or (c < 0).any():
            raise EplbError("counts must be finite and >= 0 (tokens routed to each expert or slot); "
                            "the window is unchanged")
        most = MAX_COUNT // (self.window or 1)
        with np.errstate(over="ignore"):
            total = float(c.sum())
        if total > most:
            raise EplbError(f"counts sum to {total:g} token-slots in one observation, more than "
                            f"{'2**62' if most == MAX_COUNT else f'2**62 / window = {most:g}'}: not one step's "
                            f"router counts; the window is unchanged")
        return c

    def _check_locked(self) -> bool:
        load = self._load_LE
        if load.sum() <= 0:
            self.last_check = {"step": self.step, "due": False, "reason": "no load observed"}
            return False
        pl = self.placement
        cur_L = pl.gpu_loads(load, self._bound(load)).max(axis=1)
        lb_L = lower_bound(load, pl.topology, pl.replica_count_LE)  # stats.lower_bound's bits
        gain = 1.0 - lb_L.sum() / cur_L.sum()
        due = gain >= self.min_improvement
        self.last_check = {"step": self.step, "due": bool(due), "predicted_improvement": float(gain),
                           "threshold": self.min_improvement}
        return bool(due)

    def predicted_improvement(self) -> float:
        """1 - (lower bound / current busiest-GPU load), summed over layers, on the window."""
        with self._lock:
            self._check_locked()
            return float(self.last_check.get("predicted_improvement", 0.0))

    # Rebalance --------------------------------------------------------------------------------

    def rebalance(self, *, failed_ranks=(), apply: bool = True) -> RebalanceResult:
        """Plan a new placement for the window load and the safe migration to it.

        failed_ranks: engine ranks that are gone. The plan then uses the surviving ranks only
        (same slots per GPU), restores each expert from a surviving replica, and reports
        experts that lost every replica in `lost_experts` (their copies come from the
        checkpoint: source rank -1 in the migration). apply: adopt the new placement; with
        False, call `adopt(result)` once the engine has migrated.
        """
        if not isinstance(apply, (bool, np.bool_)):
            raise EplbError(f"apply must be True or False, got {shown(apply)}")
        with self._lock:
            pl, ranks, version, step, bound = self.placement, self.rank_ids, self._version, self.step, self._bound
            load = self._load_snapshot()
        if load.sum() <= 0:
            raise EplbError("no load observed yet (or only zeros): call observe(counts) first")
        t0 = time.perf_counter()
        failed = self._failed_indices(failed_ranks, ranks)
        now = Served(pl, ranks, load, step, bound)
        with record() as interpreted:
            if self.policy is not None and not failed.size:
                decision, drafts = self._ask_policy(now)
                result = decisions.by_policy(self, now, decision, drafts, t0)
            else:
                result = decisions.by_plan(self, now, failed)
        interpreted |= result.info.pop("_schedule_interpreted", set())
        result = replace(result, seconds=time.perf_counter() - t0,
                         info={**result.info, "interpreted_kernels": sorted(interpreted)})
        if apply:
            self.adopt(result, _expect_version=version)
        return result

    def adopt(self, result: RebalanceResult, *, _expect_version: int | None = None) -> None:
        """Serve `result.placement` from now on (physical counts map through it)."""
        if not isinstance(result, RebalanceResult):
            raise EplbError(f"adopt needs the RebalanceResult of rebalance(apply=False), got {type(result).__name__}")
        new = result.placement
        ranks = np.asarray(result.rank_ids)
        if not isinstance(new, Placement) or ranks.shape != (new.num_gpus,):
            raise EplbError("adopt needs a RebalanceResult: a Placement and one engine rank per GPU")
        bound = self.dispatch.bind(new)  # outside the lock: binding SGLang's rule takes a while
        with self._lock:
            pl = self.placement
            # The window keeps logical loads of these layers and experts: a placement of another
            # shape would make every later observe fail (ranks may fail: GPUs can change).
            if (new.num_layers, new.num_logical_experts, new.slots_per_gpu) != \
                    (pl.num_layers, pl.num_logical_experts, pl.slots_per_gpu):
                raise EplbError(f"result is for {new.num_layers} layers x {new.num_logical_experts} experts, "
                                f"{new.slots_per_gpu} slots per GPU; this Rebalancer serves "
                                f"{pl.num_layers} x {pl.num_logical_experts}, {pl.slots_per_gpu} per GPU")
            if _expect_version is not None and _expect_version != self._version:
                raise EplbError("the placement changed while this rebalance was planned "
                                "(two rebalances at once?): plan again")
            # The result's migration must start from what is served now (its surviving ranks'
            # slots): a result planned before another one was adopted would move the engine
            # from a placement it no longer has.
            where = {int(r): i for i, r in enumerate(self.rank_ids)}
            pos = np.array([where.get(int(r), -1) for r in ranks], dtype=np.int64)
            L, S = pl.num_layers, pl.slots_per_gpu
            served = pl.phy2log_LP.reshape(L, pl.num_gpus, S)[:, pos].reshape(L, -1)
            if (pos < 0).any() or not np.array_equal(served, result.migration.old_LP):
                raise EplbError("this result was planned from another placement than the one served now "
                                "(another rebalance was adopted since): plan again")
            self._adopt(new, ranks, bound)

    def _failed_indices(self, failed_ranks, ranks: np.ndarray) -> np.ndarray:
        if failed_ranks is None or is_number(failed_ranks):
            given = [] if failed_ranks is None else [failed_ranks]
        else:
            try:
                given = list(failed_ranks)
            except TypeError:
                given = [failed_ranks]
        # Whole numbers only: int() would read rank 1.5 as rank 1 and plan without it.
        if not all(is_whole(r) and abs(r) < 2**62 for r in given):
            raise EplbError(f"failed_ranks must be engine ranks (whole numbers), got {shown(failed_ranks)}")
        if not given:
            return np.zeros(0, dtype=np.int64)
        failed = np.unique(np.asarray(given, dtype=np.int64))
        unknown = failed[~np.isin(failed, ranks)]
        if unknown.size:
            raise EplbError(f"failed ranks {unknown.tolist()} are not among the serving ranks {ranks.tolist()}")
        if failed.size == ranks.size:
            raise EplbError(f"all {ranks.size} ranks failed: nothing left to plan on")
        return np.flatnonzero(np.isin(ranks, failed))

    def _ask_policy(self, now: Served):
        """Hand the closed windows to the policy and ask it: (its decision or None, the drafts
        it made on the way, each with its schedule started: `decisions.start_draft`).

        Without a closed window (rebalance called before `interval` observations), the window
        being filled is closed now, so the policy sees what was observed."""
        with self._policy_lock:
            with self._lock:
                if not self._closed and self._window_obs:
                    self._closed.append((self._window_LE.copy(), self.placement))
                    self._window_LE[:] = 0.0
                    self._window_obs = 0
            while True:
                with self._lock:
                    if not self._closed:
                        break
                    window_LE, served = self._closed.popleft()
                self.policy.observe(window_LE, served)
            drafts: list = []
            kw = dict(self._decide_kw, on_draft=lambda d: decisions.start_draft(self, now, d, drafts)) \
                if self._takes_draft else self._decide_kw
            try:
                decision = self.policy.decide(now.placement, **kw)
                if decision is not None:
                    decisions.check_caps(self.policy.name, self._policy_budget, now.placement, decision.phy2log_LP)
            except BaseException:
                for _, draft in drafts:
                    draft.stop()
                raise
        return decision, drafts
