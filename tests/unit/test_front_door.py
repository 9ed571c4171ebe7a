"""Values through the front door: topology, budget, aggregation and dispatch passed whole; lazy scores."""

from __future__ import annotations

import numpy as np
import pytest

import eplb
from eplb import stats
from eplb.core.placement import Placement, contiguous_map, gpu_loads
from eplb.core.topology import Topology
from eplb.dispatch.rules import Resplit
from eplb.errors import EplbError
from eplb.evaluate.backtest import backtest
from eplb.migration import Budget
from eplb.planning import front_door as planning
from eplb.serving.rebalance import Rebalancer
from eplb.stats.loads import Aggregation
from planners import api as planner_api
from planners.api import PlanRequest, Solution


def _load(rng, L=3, E=16):
    load = rng.gamma(0.5, 100.0, (L, E))
    load[:, 3] *= 20  # one hot expert per layer: replicas matter
    return load


def test_a_topology_value_plans_as_its_sizes_do(rng):
    load = _load(rng)
    by_value = eplb.plan(load, topology=Topology(num_gpus=4, slots_per_gpu=5))
    by_sizes = eplb.plan(load, num_gpus=4, slots_per_gpu=5)
    np.testing.assert_array_equal(by_value.solution.phy2log_LP, by_sizes.solution.phy2log_LP)
    assert by_value.topology == by_sizes.topology == Topology(4, 5)
    with pytest.raises(EplbError, match="either topology .* or the sizes .*num_gpus=4"):
        eplb.plan(load, topology=Topology(4, 5), num_gpus=4)
    with pytest.raises(EplbError, match="give the GPUs to plan for"):
        eplb.plan(load)
    with pytest.raises(EplbError, match="topology must be an eplb.Topology"):
        eplb.plan(load, topology=(4, 5))
    with pytest.raises(EplbError, match="12 slots cannot hold 16 logical experts"):
        eplb.plan(load, topology=Topology(4, 3))


def test_an_aggregation_value_folds_window_and_alpha(rng):
    hist = rng.poisson(20.0, (5, 2, 8)).astype(float)
    res = eplb.plan(hist, num_gpus=2, aggregate=Aggregation("window", 2))
    np.testing.assert_array_equal(res.load_LE, hist[-2:].sum(axis=0))
    np.testing.assert_allclose(eplb.plan(hist, num_gpus=2, aggregate=Aggregation("ema", alpha=0.5)).load_LE,
                               stats.aggregate(hist, "ema", alpha=0.5))
    with pytest.raises(EplbError, match=r"window \(2\) only applies to aggregation 'window', not 'sum'"):
        Aggregation("sum", 2)
    with pytest.raises(EplbError, match="inside the Aggregation"):
        stats.aggregate(hist, Aggregation("window", 2), window=3)


def test_a_budget_value_needs_the_placement_now_served(rng):
    load = _load(rng)
    with pytest.raises(EplbError, match=r"max_moves \(3\): migration options need the placement now served"):
        eplb.plan(load, num_gpus=4, budget=Budget(max_moves=3))
    with pytest.raises(EplbError, match=r"^a budget: migration options need the placement now served"):
        eplb.plan(load, num_gpus=4, budget=Budget())
    with pytest.raises(EplbError, match="budget must be an eplb.Budget"):
        eplb.plan(load, num_gpus=4, previous=eplb.plan(load, num_gpus=4).placement, budget={"max_moves": 3})
    prev = eplb.plan(load[::-1].copy(), num_gpus=4).placement
    res = eplb.plan(load, num_gpus=4, previous=prev, budget=Budget(max_moves=2, bytes_per_expert=7))
    mig = res.info["migration"]
    assert mig["moves"] <= 2 and mig["bytes"] == 7 * mig["moves"] and mig["max_moves"] == 2


def test_scores_are_computed_on_first_access_and_cached(rng, monkeypatch):
    load = _load(rng)
    res = eplb.plan(load, num_gpus=4)
    assert not {"before", "after", "lower_bound_L", "placement"} & set(vars(res))
    calls = []
    real = planning.contiguous_placement
    monkeypatch.setattr(planning, "contiguous_placement", lambda *a: calls.append(a) or real(*a))
    planning._contiguous.cache_clear()  # plans of one shape share the baseline: count this one's build
    after = res.after
    assert calls == [] and res.after is after          # the plan's own report needs no baseline
    assert res.before is res.before and len(calls) == 1
    assert res.placement.metrics["contiguous_imbalance_median"] == pytest.approx(np.median(res.before.imbalance_L))
    assert res.placement == Placement(res.solution.phy2log_LP, 4, 16)


def test_a_rebalance_never_scores_the_contiguous_baseline(rng, monkeypatch):
    def refuse(*args):
        raise AssertionError("the serving path scored the contiguous baseline")

    start = eplb.plan(_load(rng), num_gpus=4, slots_per_gpu=6).placement   # 3 survivors can hold all 16
    rb = Rebalancer(start, interval=10**6)
    rb.observe(_load(np.random.default_rng(5)))
    monkeypatch.setattr(planning, "contiguous_placement", refuse)
    for failed in ((), (2,)):
        res = rb.rebalance(failed_ranks=failed, apply=False)
        assert set(res.placement.metrics) == {"imbalance_median", "imbalance_max", "bound_ratio_max", "balancedness"}


def test_the_dispatch_rule_reaches_the_planner_and_scores_the_result(rng, monkeypatch):
    seen = []

    class Spy:
        name = "spy"

        def plan(self, request: PlanRequest) -> Solution:
            seen.append(request.dispatch)
            return Solution(contiguous_map(request.num_logical_experts, request.topology, request.num_layers))

    monkeypatch.setattr(planner_api, "_registered", {})
    planner_api.register("spy", Spy)
    load = _load(rng)
    assert eplb.plan(load, num_gpus=4, planner="spy").dispatch.name == "plan"
    res = eplb.plan(load, num_gpus=4, dispatch=Resplit(sweeps=4))
    assert eplb.plan(load, num_gpus=4, planner="spy", dispatch="resplit").dispatch.name == "resplit"
    assert [r.name for r in seen] == ["plan", "resplit"]
    pl = res.placement
    expect = stats.evaluate(pl, load, Resplit(sweeps=4).bind(pl)(load))
    np.testing.assert_allclose(res.after.gpu_load_LG, expect.gpu_load_LG)
    assert res.summary()["dispatch"] == "resplit"
    with pytest.raises(EplbError, match="unknown dispatch rule 'fair'"):
        eplb.plan(load, num_gpus=4, dispatch="fair")


def test_failed_ranks_plan_through_the_front_door_from_the_survivors(rng):
    topo = Topology(num_gpus=4, slots_per_gpu=6)
    served = Placement(contiguous_map(16, topo, 3), 4, 16)
    survivors = served.on_gpus([0, 2, 3])
    assert survivors.partial and survivors.num_gpus == 3 and survivors.num_nodes == 1
    assert (survivors.replica_count_LE[:, 4:8] == 0).all()   # GPU 1 held experts 4..7 alone
    assert not served.on_gpus([0, 1, 2, 3]).partial
    with pytest.raises(EplbError, match="no replica"):
        Placement(survivors.phy2log_LP, 3, 16)
    with pytest.raises(EplbError, match="partial Placement"):
        Rebalancer(survivors)
    res = eplb.plan(_load(rng), topology=survivors.topology, previous=survivors, budget=Budget(move_cost=0.001))
    assert (res.placement.replica_count_LE >= 1).all()
    back = eplb.Placement.from_dict(survivors.to_dict())
    assert back == survivors and back.partial


def test_one_gpu_load_function(rng):
    load_TLE = rng.gamma(1.0, 10.0, (2, 3, 8))
    pl = eplb.plan(load_TLE.sum(axis=0), num_gpus=2).placement
    per_window = gpu_loads(pl.phy2log_LP, load_TLE, 2, pl.replica_weights())
    assert per_window.shape == (2, 3, 2)
    np.testing.assert_allclose(per_window[1], pl.gpu_loads(load_TLE[1]))
    np.testing.assert_allclose(gpu_loads(pl.phy2log_LP, load_TLE[0], 2), pl.gpu_loads(load_TLE[0]))  # even split
    phy = np.array([[0, 1, -1, 1]])                     # an empty slot serves nothing
    np.testing.assert_allclose(gpu_loads(phy, np.array([[4.0, 6.0]]), 2), [[7.0, 3.0]])
    np.testing.assert_allclose(gpu_loads(phy, np.array([[4.0, 6.0]]), 2, 1.0), [[10.0, 6.0]])


def test_backtests_take_a_topology_value(rng):
    counts = rng.poisson(30.0, (4, 2, 8)).astype(float)
    kw = dict(dispatch=("even",), oracle=False, quiet=True)
    a = backtest(counts, topology=Topology(2, 5), **kw).summary()
    b = backtest(counts, num_gpus=2, slots_per_gpu=5, **kw).summary()
    assert a["median"] == b["median"] and a["num_slots"] == 10


def test_even_split_scores_are_the_generic_ones_to_the_bit(rng):
    """PlanResult scores an even split through `stats.even_report`: the same numbers as
    binding the rule and `stats.evaluate` (the plan, and the contiguous baseline with repeats)."""
    load = _load(rng, L=4, E=16)
    for gpus, slots in ((4, 5), (8, 3), (3, 6)):
        res = eplb.plan(load, num_gpus=gpus, slots_per_gpu=slots)
        plain = Placement(res.solution.phy2log_LP, gpus, 16)
        base = planning._contiguous(16, res.topology, tuple(range(4)))
        for pl, report in ((plain, res.after), (base, res.before)):
            np.testing.assert_array_equal(stats.even_gpu_loads(pl, res.load_LE), pl.gpu_loads(res.load_LE))
            generic = stats.evaluate(pl, res.load_LE, pl.replica_weights())
            np.testing.assert_array_equal(report.gpu_load_LG, generic.gpu_load_LG)
            np.testing.assert_array_equal(report.bound_ratio_L, generic.bound_ratio_L)
            assert report.balancedness == generic.balancedness


def test_a_plans_own_optimal_counts_give_the_bound_to_the_bit():
    """planning.lower_bound proves a plan's counts min-max optimal where it can and solves the
    other layers: the same bound as stats, with greedy's counts, the uncapped optimum, random
    counts, and all-zero or single-expert layers."""
    from planners.greedy import replicate

    rng = np.random.default_rng(3)
    for case in range(300):
        E = int(rng.integers(1, 20))
        G = int(rng.integers(1, 8))
        S = int(rng.integers(-(-E // G), E + 1))
        load = [np.floor(rng.pareto(0.8, (4, E)) * 10), rng.integers(0, 3, (4, E)).astype(float),
                rng.random((4, E))][case % 3]
        load[0] = 0.0
        topo = Topology(G, S)
        want = stats.lower_bound(load, G, G * S)
        random_LE = np.ones((4, E), dtype=np.int64)
        for row in random_LE:
            np.add.at(row, rng.integers(0, E, G * S - E), 1)
        for count_LE in (replicate(load, G * S, G), replicate(load, G * S, G * S), random_LE):
            np.testing.assert_array_equal(planning.lower_bound(load, topo, count_LE), want)
    res = eplb.plan(_load(rng), num_gpus=4, slots_per_gpu=5)
    np.testing.assert_array_equal(res.lower_bound_L, stats.lower_bound(res.load_LE, 4, 20))
