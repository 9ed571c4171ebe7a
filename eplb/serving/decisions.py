"""How one rebalance decides, from what is served when it starts (`Served`).

Legend: L = MoE layers, E = logical experts, G = GPUs (ranks), P = physical slots.

Two ways, chosen by the `Rebalancer`:
- `by_policy`: the online policy's decision (or none: keep), its schedule started as soon as
  the policy drafted it (`start_draft`);
- `by_plan`: a placement planned through the front door (`eplb.plan`, migration-aware) from
  what the serving GPUs hold: policy=None, and every rebalance after failed ranks (planned on
  the survivors).
Both start the migration schedule on a side thread and score the served and the new
placement beside it, under the served dispatch rule, on the same load and lower bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from eplb import stats
from eplb.core.placement import Placement
from eplb.errors import EplbError
from eplb.migration import MigrationPlan, count_moves
from eplb.migration.schedule.rounds import ScheduleThread
from eplb.planning.front_door import even_split, lower_bound, plan
from eplb.stats.loads import group_span


@dataclass(frozen=True, eq=False)
class RebalanceResult:
    """What one rebalance decided."""

    placement: Placement
    """The new placement (on the surviving ranks only, when ranks failed)."""
    before: stats.LoadReport
    """The placement that was serving, scored on the window load (all ranks alive)."""
    after: stats.LoadReport
    """The new placement, scored on the same load."""
    migration: MigrationPlan
    """Safe rounds of copies from the old placement (survivors' slots) to the new one."""
    rank_ids: np.ndarray
    """Engine rank of each GPU index of `placement`, int64 [G'] (all ranks unless some failed)."""
    lost_experts: tuple[tuple[int, int], ...] = ()
    """(layer index, expert) pairs that lost every replica: reloaded from the checkpoint."""
    step: int = 0
    """Observations seen when the rebalance was planned."""
    seconds: float = 0.0
    """Wall time of planning + scheduling (info has "decision_seconds" for the placement,
    "schedule_seconds" for the migration schedule, which runs on a side thread beside the
    scoring of both placements, and "interpreted_kernels": the kernels that ran as plain Python,
    before their machine code was ready (eplb.core.jit: the first decisions after an install))."""
    message: str = ""
    """How the plan was made (planner status, budget, fallbacks)."""
    info: dict = field(default_factory=dict)
    """Move counts and timings (JSON-ready)."""

    @property
    def moves(self) -> int:
        return self.migration.moves

    def summary(self) -> dict:
        """JSON-ready summary."""
        return {
            "step": self.step, "seconds": self.seconds, "message": self.message,
            "imbalance_before": float(np.median(self.before.imbalance_L)),
            "imbalance_after": float(np.median(self.after.imbalance_L)),
            "balancedness_before": self.before.balancedness,
            "balancedness_after": self.after.balancedness,
            "migration": self.migration.summary(),
            "lost_experts": [list(x) for x in self.lost_experts],
            "rank_ids": self.rank_ids.tolist(), "info": self.info,
        }


@dataclass(frozen=True, eq=False)
class Served:
    """What a rebalance starts from, taken under the Rebalancer's lock in one piece."""

    placement: Placement
    rank_ids: np.ndarray
    """Engine rank of each GPU index, int64 [G]."""
    load_LE: np.ndarray
    """The window load the rebalance plans on, float64 [L, E] (a copy)."""
    step: int
    """Observations seen so far."""
    bound: object
    """The dispatch rule bound to `placement`."""


def by_plan(rb, now: Served, failed: np.ndarray) -> RebalanceResult:
    """Plan through the front door from what the serving GPUs hold (all of them, or the
    survivors when the GPU indices `failed` are gone: their own slots, planned as one node),
    then schedule."""
    t0 = time.perf_counter()
    pl, ranks, load = now.placement, now.rank_ids, now.load_LE
    L, E, G, S = pl.num_layers, pl.num_logical_experts, pl.num_gpus, pl.slots_per_gpu
    alive = np.setdiff1d(np.arange(G), failed)
    if alive.size * S < E:
        Ga = alive.size
        raise EplbError(f"{Ga} surviving ranks x {S} slots = {Ga * S} slots cannot hold {E} experts: "
                        f"add ranks or slots per GPU (at least {-(-E // Ga)} per GPU on {Ga} ranks)")
    served = pl.on_gpus(alive) if failed.size else pl
    res = plan(load, topology=served.topology, planner=rb.planner, settings=rb.settings,
               num_expert_groups=rb.num_expert_groups, previous=served, budget=rb.budget,
               objective=rb.objective, dispatch=rb.dispatch)
    sol, after = res.solution, res.after
    # The plan's own report, not PlanResult.placement: that one scores the contiguous baseline too.
    metrics = {**after.metrics(), **res.objective_metrics}
    new = replace(served, phy2log_LP=sol.phy2log_LP, dispatch_weights_LP=sol.dispatch_weights_LP,
                  planner=res.planner, metrics=metrics, partial=False)
    t1 = time.perf_counter()
    # Both maps are Placements' (checked when built): the schedule trusts them, and runs
    # beside the scoring of the placement that was serving.
    side = start_schedule(rb, served, new, ranks[alive])
    # The plan was scored on this same load (and, with every rank alive, topology): reuse its bound.
    before = score(rb, pl, load, lower_bound(load, pl.topology) if failed.size else res.lower_bound_L, now.bound)
    mig = side.result()
    info = dict(res.info.get("migration", {}))
    info.update(decision_seconds=t1 - t0, schedule_seconds=side.seconds, _schedule_interpreted=side.interpreted)
    message = f"{res.planner}: {res.status}" + (f" ({res.message})" if res.message else "")
    lost: tuple[tuple[int, int], ...] = ()
    if failed.size:
        present = np.zeros((L, E), dtype=bool)
        present[np.arange(L)[:, None], served.phy2log_LP] = True
        lost = tuple((int(l), int(e)) for l, e in np.argwhere(~present))
        info["failed_ranks"] = ranks[failed].tolist()
        message = (f"ranks {ranks[failed].tolist()} failed: planned on {alive.size} surviving ranks (one node), "
                   f"{len(lost)} expert replicas lost everywhere and reloaded from the checkpoint")
    return RebalanceResult(placement=new, before=before, after=after, migration=mig, rank_ids=ranks[alive],
                           lost_experts=lost, step=now.step, message=message, info=info)


def by_policy(rb, now: Served, decision, drafts: list, t0: float) -> RebalanceResult:
    """The result of the policy's `decision` (None: keep the placement), given the drafts it
    made on the way ((Placement, ScheduleThread) pairs, `start_draft`) and when it was asked."""
    pl, ranks, load = now.placement, now.rank_ids, now.load_LE
    # A draft that came out as the decision is its placement, and its schedule the decision's
    # (a schedule depends on the two maps alone); the others are stopped.
    new, side = pl, None
    for draft_pl, draft in drafts:
        if side is None and decision is not None and np.array_equal(draft_pl.phy2log_LP, decision.phy2log_LP):
            new, side = draft_pl, draft
        else:
            draft.stop()
    if decision is not None and side is None:
        new = replace(pl, phy2log_LP=decision.phy2log_LP, dispatch_weights_LP=None, planner=rb.policy.name)
    t1 = time.perf_counter()
    # Both maps are Placements' (checked when built): the schedule trusts them, and runs beside
    # the scoring below.
    if side is None:
        side = start_schedule(rb, pl, new, ranks)
    # One bound for both scores (the same load on the same topology): proven from the new
    # placement's counts in the layers where they are min-max optimal for this load, solved
    # (greedy's counts) in the others.
    lb_L = lower_bound(load, pl.topology, new.replica_count_LE)
    before = score(rb, pl, load, lb_L, now.bound)
    after = before if decision is None else score(rb, new, load, lb_L)
    new = new.with_metrics(after.metrics())  # the map is checked once, by the replace above
    mig = side.result()
    info = {"decision_seconds": t1 - t0, "schedule_seconds": side.seconds,
            "_schedule_interpreted": side.interpreted, "moves": mig.moves,
            "changed_layers": 0 if decision is None else int(decision.changed_L.sum())}
    if pl.num_nodes > 1 and rb.num_expert_groups:
        for k, m in (("before", pl), ("after", new)):
            info[f"group_span_{k}"] = float(group_span(m.phy2log_LP, pl.topology, rb.num_expert_groups,
                                                       pl.num_logical_experts).mean())
    msg = f"policy {rb.policy.name}: " + ("keep (no change pays for its moves)" if decision is None
                                          else decision.reason)
    return RebalanceResult(placement=new, before=before, after=after, migration=mig, rank_ids=ranks,
                           step=now.step, message=msg, info=info)


def start_draft(rb, now: Served, draft, drafts: list) -> None:
    """The policy's draft decision (see `Policy`) as a Placement (its map checked) and its
    migration schedule, started on a side thread: listed in drafts together."""
    if draft is None:
        return
    pl = now.placement
    draft_pl = replace(pl, phy2log_LP=draft.phy2log_LP, dispatch_weights_LP=None, planner=rb.policy.name)
    drafts.append((draft_pl, start_schedule(rb, pl, draft_pl, now.rank_ids)))


def start_schedule(rb, served: Placement, new: Placement, ranks: np.ndarray) -> ScheduleThread:
    """The migration schedule from served to new (Placements of one topology, their maps
    checked when built: the schedule trusts them) on a side thread."""
    return ScheduleThread(served.phy2log_LP, new.phy2log_LP, new.num_gpus, new.num_logical_experts,
                          rb.layers_per_chunk, ranks, rb.budget.bytes_per_expert)


def score(rb, pl: Placement, load: np.ndarray, lb_L: np.ndarray, bound=None) -> stats.LoadReport:
    """pl scored on the window load [L, E] (checked when observed) under the served rule
    (`bound`: the rule bound to pl, bound here when None), against the lower bound lb_L [L].
    An even split skips the rule: `stats.even_report` gives `stats.evaluate`'s bits."""
    if even_split(rb.dispatch, pl):
        return stats.even_report(pl, load, lb_L)
    return stats.evaluate(pl, load, (bound or rb.dispatch.bind(pl))(load), lower_bound_L=lb_L)


def check_caps(policy_name: str, budget, pl: Placement, new_LP: np.ndarray) -> None:
    """A policy's decision must keep the budget's move caps (a policy object could ignore them)."""
    b = budget
    if b is None or (b.max_moves is None and b.max_moves_per_gpu is None):
        return
    moves_G = count_moves(pl.phy2log_LP, new_LP, pl.num_gpus, pl.num_logical_experts).sum(axis=0)
    if (b.max_moves is not None and moves_G.sum() > b.max_moves) or \
            (b.max_moves_per_gpu is not None and moves_G.max() > b.max_moves_per_gpu):
        raise EplbError(f"policy {policy_name!r} decided {int(moves_G.sum())} moves (at most "
                        f"{int(moves_G.max())} onto one GPU) against max_moves={b.max_moves}, "
                        f"max_moves_per_gpu={b.max_moves_per_gpu}: its decide() must honour the budget")
