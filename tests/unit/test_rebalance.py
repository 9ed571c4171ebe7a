"""Rebalancer: observe / decide / rebalance, failed ranks, threads (eplb.serving.rebalance)."""

import threading

import numpy as np
import pytest

from eplb import Budget, EplbError, Placement, plan, stats
from eplb.migration import count_moves
from eplb.serving.rebalance import Rebalancer

L, E, G = 3, 32, 4


def skewed(rng, hot):
    load = rng.gamma(2.0, 10.0, (L, E))
    load[:, hot] *= 12.0
    return load


@pytest.fixture
def start(rng):
    return plan(skewed(rng, [0, 1]), num_gpus=G, num_redundant=8).placement


def test_physical_counts_map_back_to_logical(rng, start):
    logical = rng.poisson(50.0, (L, E)).astype(float)
    a, b = Rebalancer(start, interval=10**6), Rebalancer(start, interval=10**6)
    a.observe(logical)
    share_LP = np.take_along_axis(logical, start.phy2log_LP, axis=1) * start.replica_weights()
    b.observe(share_LP)
    assert np.allclose(a.load_LE, b.load_LE)


def test_ambiguous_shape_needs_physical_flag():
    pl = Placement(np.tile(np.arange(8), (2, 1)), 4, 8)            # E == P
    rb = Rebalancer(pl, interval=10)
    with pytest.raises(EplbError, match="physical=True"):
        rb.observe(np.ones((2, 8)))
    rb.observe(np.ones((2, 8)), physical=False)
    with pytest.raises(EplbError, match=r"\[2, 8\]"):
        rb.observe(np.ones((2, 5)))


def test_window_and_ema(rng, start):
    steps = rng.poisson(20.0, (7, L, E)).astype(float)
    win = Rebalancer(start, window=3, interval=10**6)
    ema = Rebalancer(start, alpha=0.25, interval=10**6)
    total = Rebalancer(start, interval=10**6)
    for c in steps:
        win.observe(c)
        ema.observe(c)
        total.observe(c)
    assert np.allclose(win.load_LE, steps[-3:].sum(axis=0))
    assert np.allclose(ema.load_LE, stats.ema(steps, 0.25)[-1])
    assert np.allclose(total.load_LE, steps.sum(axis=0))


def test_decision_rule_checks_every_interval_against_threshold(rng, start):
    shifted = skewed(rng, [7, 20])                  # new hot experts: worth rebalancing
    rb = Rebalancer(start, interval=5, min_improvement=0.05, policy=None)
    due = [rb.observe(shifted) for _ in range(10)]
    assert due == [False] * 4 + [True] + [False] * 4 + [True]
    assert rb.last_check["predicted_improvement"] >= 0.05
    lazy = Rebalancer(start, interval=5, min_improvement=0.99, policy=None)
    assert not any(lazy.observe(shifted) for _ in range(10))
    assert lazy.last_check["due"] is False


def test_rebalance_improves_and_adopts(rng, start):
    shifted = skewed(rng, [7, 20])
    rb = Rebalancer(start, interval=1, budget=Budget(max_moves=12, bytes_per_expert=1000))
    rb.observe(shifted)
    res = rb.rebalance()
    assert res.after.balancedness > res.before.balancedness
    assert res.moves <= 12
    assert res.migration.bytes == 1000 * (res.migration.network_mask.sum())
    assert np.array_equal(res.migration.state_before(res.migration.num_rounds), res.placement.phy2log_LP)
    res.migration.check()
    assert rb.placement is res.placement
    assert np.allclose(rb.load_LE, shifted)         # logical window survives the switch
    with pytest.raises(EplbError, match="observe"):
        Rebalancer(start).rebalance()


def test_rebalance_without_apply_leaves_placement(rng, start):
    rb = Rebalancer(start, interval=1)
    rb.observe(skewed(rng, [9]))
    res = rb.rebalance(apply=False)
    assert rb.placement is start
    rb.adopt(res)
    assert rb.placement is res.placement


def test_failed_ranks_plan_on_survivors_and_report_lost_experts(rng):
    # Rank 1 holds the only replicas of experts 8..15 (contiguous placement): they are lost.
    from eplb.core.placement import contiguous_map
    from eplb.core.topology import Topology

    topo = Topology(num_gpus=G, slots_per_gpu=12)
    pl = Placement(contiguous_map(E, topo, L), G, E)
    rb = Rebalancer(pl, interval=1)
    rb.observe(skewed(rng, [3]))
    res = rb.rebalance(failed_ranks=[1])
    assert res.rank_ids.tolist() == [0, 2, 3]
    assert res.placement.num_gpus == 3
    assert sorted(res.lost_experts) == [(l, e) for l in range(L) for e in range(8, 16)]
    assert res.migration.reloads == len(res.lost_experts)
    assert (res.placement.replica_count_LE >= 1).all()
    res.migration.check()
    # Surviving replicas stay where they were: the survivors' old slots are mostly kept.
    old = pl.phy2log_LP.reshape(L, G, 12)[:, [0, 2, 3]].reshape(L, -1)
    assert (old == res.placement.phy2log_LP).mean() > 0.5
    # Physical counts now map through the 3-rank placement.
    rb.observe(np.ones((L, 36)))


def test_failed_rank_errors(rng, start):
    rb = Rebalancer(start, interval=1)
    rb.observe(skewed(rng, [3]))
    with pytest.raises(EplbError, match=r"failed ranks \[9\]"):
        rb.rebalance(failed_ranks=[9])
    with pytest.raises(EplbError, match="all 4 ranks failed"):
        rb.rebalance(failed_ranks=[0, 1, 2, 3])
    with pytest.raises(EplbError, match="cannot hold 32 experts"):
        rb.rebalance(failed_ranks=[0, 1])          # 2 ranks x 10 slots < 32


def test_bad_settings_name_the_value(start):
    with pytest.raises(EplbError, match="interval"):
        Rebalancer(start, interval=0)
    with pytest.raises(EplbError, match="alpha"):
        Rebalancer(start, alpha=1.5)
    with pytest.raises(EplbError, match="window"):
        Rebalancer(start, window=3, alpha=0.5)
    with pytest.raises(EplbError, match="unknown planner"):
        Rebalancer(start, planner="nope")


def test_observe_from_threads_while_rebalancing(rng, start):
    rb = Rebalancer(start, interval=10**6)
    skewed_first = skewed(rng, [5, 6])
    rb.observe(skewed_first)
    counts = rng.poisson(5.0, (L, E)).astype(float)
    errors = []

    def feed():
        try:
            for _ in range(200):
                rb.observe(counts)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=feed) for _ in range(3)]
    for t in threads:
        t.start()
    res = rb.rebalance()
    for t in threads:
        t.join()
    assert not errors
    assert rb.step == 601
    assert rb.placement is res.placement
    # No observation was lost or counted twice around the switch.
    assert np.allclose(rb.load_LE, skewed_first + 600 * counts)


def test_failed_rank_leaving_as_many_slots_as_experts():
    """5 GPUs x 4 slots, 16 experts: one rank fails and 16 slots remain. The migration must
    stage through the slots of the lost experts before reloading them (it was refused as
    'no safe migration' every time)."""
    rng = np.random.default_rng(0)
    for seed in range(5):
        r = np.random.default_rng(seed)
        pl = plan(r.gamma(0.5, 10, (3, 16)), num_gpus=5, slots_per_gpu=4).placement
        rb = Rebalancer(pl, interval=10**6)
        rb.observe(r.gamma(0.5, 10, (3, 16)))
        res = rb.rebalance(failed_ranks=[int(rng.integers(5))])
        res.migration.check()
        assert res.placement.num_slots == 16 and res.lost_experts


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_observe_refuses_counts_that_are_not_finite_and_non_negative(rng, start, bad):
    """One NaN used to stay in a sliding-window sum forever (NaN - NaN is NaN), and negative
    counts made the load negative: both must be refused, leaving the window as it was."""
    rb = Rebalancer(start, window=2, interval=10**6)
    good = rng.poisson(5.0, (L, E)).astype(float)
    rb.observe(good)
    for physical in (False, True):
        c = np.ones((L, E if not physical else start.num_slots))
        c[1, 3] = bad
        with pytest.raises(EplbError, match="finite and >= 0"):
            rb.observe(c, physical=physical)
    assert rb.step == 1 and np.array_equal(rb.load_LE, good)



def test_window_of_float_counts_never_plans_on_negative_load(start):
    """A sliding sum of float counts leaves rounding residue such as -1e-16 where the window
    holds only zeros; plan() refuses negative loads, so rebalance failed."""
    rb = Rebalancer(start, window=3, interval=10**6)
    r = np.random.default_rng(1)
    for _ in range(200):
        rb.observe(r.random((L, E)) * (r.random((L, E)) < 0.5))
    assert (rb.load_LE >= 0).all()
    rb.rebalance()



def test_adopt_refuses_a_result_for_another_model(rng, start):
    """A placement of other layers / experts was adopted, and every later observe failed."""
    rb = Rebalancer(start, interval=10**6)
    foreign = plan(rng.gamma(1.0, 10.0, (L + 1, E)), num_gpus=G, num_redundant=8).placement
    rb2 = Rebalancer(foreign, interval=10**6)
    rb2.observe(rng.gamma(1.0, 10.0, (L + 1, E)))
    with pytest.raises(EplbError, match="layers"):
        rb.adopt(rb2.rebalance(apply=False))
    assert rb.placement is start
    rb.observe(rng.poisson(5.0, (L, E)).astype(float))     # still serving the old shape


def test_adopt_refuses_a_result_planned_before_another_was_adopted(rng, start):
    """rebalance(apply=False) on one thread, rebalance() on another: the first result's
    migration starts from a placement no longer served, and adopting it must fail."""
    rb = Rebalancer(start, interval=10**6)
    rb.observe(skewed(rng, [9]))
    stale = rb.rebalance(apply=False)
    rb.observe(skewed(rng, [20, 21]) * 50)
    fresh = rb.rebalance()
    assert not np.array_equal(fresh.placement.phy2log_LP, start.phy2log_LP)
    with pytest.raises(EplbError, match="another placement"):
        rb.adopt(stale)
    assert rb.placement is fresh.placement
    # A failed-rank result adopted later (apply=False) starts from the survivors' slots.
    rb = Rebalancer(plan(skewed(rng, [1]), num_gpus=G, num_redundant=16).placement, interval=10**6)
    rb.observe(skewed(rng, [9]))
    rb.adopt(rb.rebalance(failed_ranks=[2], apply=False))
    assert rb.rank_ids.tolist() == [0, 1, 3]


@pytest.mark.parametrize("kw, match", [
    (dict(layers_per_chunk=0), "layers_per_chunk"), (dict(layers_per_chunk=1.5), "layers_per_chunk"),
    (dict(budget=dict(bytes_per_expert=-1)), "bytes_per_expert"),
    (dict(budget=dict(bytes_per_expert=2.5)), "bytes_per_expert"),
    (dict(interval="a"), "interval"), (dict(window="a"), "window"), (dict(window=True), "window"),
    (dict(budget=dict(move_cost="a")), "move_cost"), (dict(budget=dict(span_cost=None)), "span_cost"),
])
def test_settings_used_only_at_rebalance_are_checked_when_built(start, kw, match):
    """layers_per_chunk=0 or bytes_per_expert=-1 were stored and failed only after a
    rebalance had planned; strings gave a ValueError traceback."""
    with pytest.raises(EplbError, match=match):
        Rebalancer(start, **{k: Budget(**v) if k == "budget" else v for k, v in kw.items()})


def test_failed_ranks_must_be_engine_ranks(rng, start):
    """failed_ranks=[1.5] was truncated to rank 1 and planned without it."""
    start = plan(skewed(rng, [1]), num_gpus=G, num_redundant=16).placement       # 3 ranks can hold all
    rb = Rebalancer(start, interval=10**6)
    rb.observe(skewed(rng, [3]))
    for bad in ([1.5], ["a"], [[1]]):
        with pytest.raises(EplbError, match="failed_ranks"):
            rb.rebalance(failed_ranks=bad)
    assert rb.placement is start
    res = rb.rebalance(failed_ranks=np.int64(3), apply=False)       # one rank, as a scalar
    assert res.rank_ids.tolist() == [0, 1, 2]
    assert rb.rebalance(failed_ranks=None, apply=False).rank_ids.tolist() == [0, 1, 2, 3]
    assert rb.rebalance(failed_ranks={1}, apply=False).rank_ids.tolist() == [0, 2, 3]
    assert rb.rebalance(failed_ranks=(r for r in [2]), apply=False).rank_ids.tolist() == [0, 1, 3]


def test_physical_observes_race_repeated_rebalances(rng):
    """Threads observe physical-slot counts while another thread rebalances (and adopts) again
    and again: every count lands in the window exactly once, whatever placement it was mapped
    through (the per-layer totals are placement-free), and no call sees a half-switched state."""
    pl = plan(skewed(rng, [0, 1]), num_gpus=G, num_redundant=8).placement
    rb = Rebalancer(pl, interval=10**6, budget=Budget(move_cost=0.0))
    rb.observe(skewed(rng, [4]))
    first = rb.load_LE.sum(axis=1)
    P = pl.num_slots
    counts = rng.poisson(3.0, (L, P)).astype(float)
    errors, results = [], []

    def feed():
        try:
            for _ in range(300):
                rb.observe(counts, physical=True)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def rebalance():
        try:
            for _ in range(5):
                results.append(rb.rebalance())
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=feed) for _ in range(3)] + [threading.Thread(target=rebalance)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert rb.step == 901 and len(results) == 5
    assert rb.placement is results[-1].placement
    np.testing.assert_allclose(rb.load_LE.sum(axis=1), first + 900 * counts.sum(axis=1))
    for r in results:
        r.migration.check()


def test_sliding_window_memory_is_bounded():
    # Issue 12: window=1000 stored every observation (113 MB at 58 x 256); bucket sums do not.
    pl = Placement(np.tile(np.arange(288) % 256, (58, 1)), 32, 256)
    rb = Rebalancer(pl, window=1000, interval=10**6)
    assert rb._sliding.nbytes <= 16 * 2**20
    assert Rebalancer(pl, window=10**6, interval=10**6)._sliding.nbytes <= 16 * 2**20


def test_policy_decides_from_windows_of_interval_observations(rng):
    steady = skewed(rng, [0, 1]) * 4
    start = plan(steady, num_gpus=G, num_redundant=8, planner="robust").placement
    rb = Rebalancer(start, interval=4, policy="adaptive")
    due = [rb.observe(rng.poisson(steady)) for _ in range(24)]
    assert due == [False, False, False, True] * 6
    first = rb.rebalance()
    assert "policy adaptive" in first.message
    for _ in range(24):
        rb.observe(rng.poisson(steady))
    again = rb.rebalance()                                   # same traffic: nothing left that pays
    assert again.moves <= first.moves and again.moves <= 8
    hot = steady.copy()
    hot[:, [9, 23]] *= 30.0                                  # two cold experts turn hot
    for _ in range(8):
        rb.observe(rng.poisson(hot))
    before = rb.placement
    res = rb.rebalance()
    assert res.moves > 0 and res.info["changed_layers"] >= 1
    assert res.migration.old_LP.tolist() == before.phy2log_LP.tolist()
    assert rb.placement.replica_count_LE[:, [9, 23]].sum() > before.replica_count_LE[:, [9, 23]].sum()
    with pytest.raises(EplbError, match="unknown policy"):
        Rebalancer(start, policy="nope")


def _policy_case(rng, hot=(9, 23)):
    """A robust plan for steady traffic, then windows where cold experts turn hot."""
    steady = skewed(rng, [0, 1]) * 4
    start = plan(steady, num_gpus=G, num_redundant=8, planner="robust").placement
    shifted = steady.copy()
    shifted[:, list(hot)] *= 30.0
    return start, steady, shifted


def test_the_adaptive_policy_is_the_default(rng):
    start, steady, shifted = _policy_case(rng)
    rb = Rebalancer(start, interval=2)
    assert rb.policy is not None and rb.policy.name == "adaptive"
    for _ in range(6):
        rb.observe(rng.poisson(shifted))
    res = rb.rebalance()
    assert "policy adaptive" in res.message and res.moves > 0
    assert res.after.balancedness > res.before.balancedness
    assert set(res.placement.metrics) == {"imbalance_median", "imbalance_max", "bound_ratio_max", "balancedness"}
    res.migration.check()
    with pytest.raises(EplbError, match="min_improvement .* policy=None"):
        Rebalancer(start, policy="adaptive", min_improvement=0.05)
    assert Rebalancer(start, policy=None).min_improvement == 0.02
    # The default asks for the min_improvement rule when one is given, and under a rule that
    # splits by the layout, which the adaptive repair cannot price.
    assert Rebalancer(start, min_improvement=0.05).policy is None
    assert Rebalancer(start, dispatch="sglang-static").policy is None


def test_rebalance_hands_the_window_being_filled_when_none_closed(rng):
    start, steady, shifted = _policy_case(rng)
    rb = Rebalancer(start, interval=10**6)
    rb.observe(shifted)
    res = rb.rebalance()
    assert res.moves > 0                                      # the one observation reached the policy
    assert rb.rebalance().moves <= res.moves                  # nothing new: at most a little more


@pytest.mark.parametrize("budget", [Budget(max_moves=3), Budget(max_moves_per_gpu=1),
                                    Budget(max_moves=5, max_moves_per_gpu=2)])
def test_the_policy_keeps_the_budgets_move_caps(rng, budget):
    start, steady, shifted = _policy_case(rng, hot=(9, 23, 17, 30))
    free = Rebalancer(start, interval=1)
    free.observe(shifted)
    uncapped = free.rebalance(apply=False)
    rb = Rebalancer(start, interval=1, budget=budget)
    rb.observe(shifted)
    res = rb.rebalance()
    moves_G = count_moves(start.phy2log_LP, res.placement.phy2log_LP, G, E).sum(axis=0)
    assert 0 < moves_G.sum() < uncapped.moves
    assert budget.max_moves is None or moves_G.sum() <= budget.max_moves
    assert budget.max_moves_per_gpu is None or moves_G.max() <= budget.max_moves_per_gpu
    assert res.after.balancedness > res.before.balancedness  # the moves it may make still help


def test_the_policy_pays_the_budgets_move_cost(rng):
    start, steady, shifted = _policy_case(rng)
    moves = []
    for cost in (0.0, 0.01, 10.0):
        rb = Rebalancer(start, interval=1, budget=Budget(move_cost=cost))
        rb.observe(shifted)
        moves.append(rb.rebalance().moves)
    assert moves[0] >= moves[1] and moves[2] == 0 < moves[0]


def test_the_policy_prices_spreading_groups_over_nodes():
    from eplb.stats.loads import group_span

    rng = np.random.default_rng(9)
    a, b = rng.gamma(0.4, 100.0, (2, 4, 64))
    prev = plan(a, num_gpus=8, num_nodes=2, num_redundant=8, planner="hierarchical", num_expert_groups=8).placement
    span = {}
    for cost in (0.0, 20.0):
        rb = Rebalancer(prev, interval=1, num_expert_groups=8, budget=Budget(span_cost=cost))
        rb.observe(b)
        served = rb.rebalance().placement
        span[cost] = group_span(served.phy2log_LP, served.topology, 8, 64).sum()
    assert span[20.0] < span[0.0]


def test_the_policy_plans_for_the_time_objective():
    from eplb.dispatch.cost import TimeObjective, cost_model

    r = np.random.default_rng(3)
    load = np.floor(r.pareto(1.2, (2, 256)) * 100) + 1
    obj = TimeObjective(cost_model("deepseek-v3", "h200"), batch_tokens=64)
    start = plan(load, num_gpus=8, num_redundant=8).placement
    rb = Rebalancer(start, interval=1, objective=obj)
    assert rb.policy.objective is obj
    rb.observe(load[::-1].copy())
    res = rb.rebalance()
    assert res.moves > 0
    # The policy planned on expected seconds, not tokens: its windows are planning loads.
    np.testing.assert_allclose(rb.policy._windows(start.topology)[0], obj.planning_load(load[::-1], start.topology))


def test_policy_objects_that_cannot_honour_a_budget_are_refused(rng):
    start, steady, shifted = _policy_case(rng)

    class Keep:
        name = "keep"

        def observe(self, counts_LE, placement):
            pass

        def decide(self, placement):
            return None

    keep = Rebalancer(start, policy=Keep(), interval=1)
    keep.observe(shifted)
    assert keep.rebalance().moves == 0 and np.array_equal(keep.placement.phy2log_LP, start.phy2log_LP)
    with pytest.raises(EplbError, match="decides without a budget"):
        Rebalancer(start, policy=Keep(), budget=Budget(max_moves=4))
    with pytest.raises(EplbError, match="objective 'time' applies to a policy given by name"):
        from eplb.dispatch.cost import TimeObjective, cost_model

        Rebalancer(start, policy=Keep(), objective=TimeObjective(cost_model("deepseek-v3", "h200")))
