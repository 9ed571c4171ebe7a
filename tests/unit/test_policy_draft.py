"""The adaptive policy's draft decision: the Rebalancer schedules it while the policy offers fresh
plans, keeps that schedule when the decision comes out as drafted, and stops it otherwise."""

import numpy as np
import pytest

from eplb import plan
from eplb.migration import schedule
from eplb.migration.schedule.rounds import ScheduleThread, schedule_trusted
from eplb.serving import decisions
from eplb.serving.policy import AdaptivePolicy
from eplb.serving.rebalance import Rebalancer
from tests.placements import skewed_counts

L, E, G, S = 4, 32, 16, 3


def workload(seed):
    return skewed_counts(seed, L, E)


def drifted(load, seed):
    """load with each expert's count scaled by up to +-30%: the same workload, drifting."""
    return load * np.random.default_rng(seed).uniform(0.7, 1.3, load.shape)


@pytest.mark.parametrize("switch", [False, True])
def test_a_draft_is_the_decision_unless_a_fresh_plan_replaces_a_repair(switch):
    start = plan(workload(1), num_gpus=G, slots_per_gpu=S).placement
    seen = workload(2) if switch else drifted(workload(1), 3)
    plain, drafting = AdaptivePolicy(), AdaptivePolicy()
    for p in (plain, drafting):
        p.observe(seen, start)
    drafts = []
    want, got = plain.decide(start), drafting.decide(start, on_draft=drafts.append)
    assert len(drafts) == 1 and want is not None
    assert np.array_equal(got.phy2log_LP, want.phy2log_LP)
    assert np.array_equal(drafts[0].phy2log_LP, want.phy2log_LP) == (not switch)


@pytest.mark.parametrize("switch", [False, True])
def test_the_rebalancer_keeps_a_drafts_schedule_only_when_the_decision_matches(switch, monkeypatch):
    start = plan(workload(1), num_gpus=G, slots_per_gpu=S).placement
    stopped, drafted = [], []
    stop, draft = ScheduleThread.stop, decisions.start_draft
    monkeypatch.setattr(ScheduleThread, "stop", lambda self: (stopped.append(self), stop(self))[1])
    monkeypatch.setattr(decisions, "start_draft",
                        lambda rb, now, d, drafts: (drafted.append(d), draft(rb, now, d, drafts))[1])
    rb = Rebalancer(start, interval=1)     # the adaptive policy
    rb.observe(workload(2) if switch else drifted(workload(1), 3))
    res = rb.rebalance()
    assert len(drafted) == 1 and drafted[0] is not None
    assert len(stopped) == int(switch)
    # Either way the migration is the schedule of the decision's own maps.
    ref = schedule(start.phy2log_LP, res.placement.phy2log_LP, G, E)
    assert np.array_equal(res.migration.round_M, ref.round_M)
    assert np.array_equal(res.migration.dst_slot_M, ref.dst_slot_M)


def test_a_stopped_schedule_ends_without_a_plan():
    old = plan(workload(1), num_gpus=G, slots_per_gpu=S).placement.phy2log_LP
    new = plan(workload(2), num_gpus=G, slots_per_gpu=S).placement.phy2log_LP
    ranks = np.arange(G)
    assert schedule_trusted(old, new, G, E, None, ranks, None, stop=np.ones(1, dtype=np.int64)) is None
    assert schedule_trusted(old, new, G, E, None, ranks, None).num_rounds > 0
