"""Planner tests: DeepSeek's golden example, and invariants run over EVERY registered planner.

Legend: L = MoE layers, E = logical experts, G = GPUs, N = nodes, S = slots per GPU, P = G x S.

A planner may declare `one_replica_per_gpu = False` (class attribute) when it does not promise
that one GPU never holds two replicas of one expert; every other planner is held to it.
Solver planners (a `time_limit` setting) get a short limit and are not required to be
deterministic (a time-limited search may stop at a different point).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eplb
from eplb import stats
from eplb.core.placement import Placement
from eplb.core.topology import Topology
from eplb.errors import EplbError
from eplb.stats.loads import group_span
from planners.api import PlanRequest, get_planner, planner_class, planner_names
from planners.deepseek import rebalance_experts

# DeepSeek's EPLB README worked example (github.com/deepseek-ai/EPLB, "Interface and Example"):
# 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs, and the map it prints.
README_WEIGHT = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                          [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
README_PHY2LOG = np.array([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                           [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])

PLANNERS = planner_names()


def fast_settings(name: str) -> dict:
    """Settings that keep slow planners quick in tests, found by the constructor's parameters."""
    params = inspect.signature(planner_class(name).__init__).parameters
    out = {}
    if "time_limit" in params:
        out["time_limit"] = 0.3
    if "workers" in params:
        out["workers"] = 1
    if "quiet" in params:
        out["quiet"] = True
    return out


def is_time_limited(name: str) -> bool:
    return "time_limit" in inspect.signature(planner_class(name).__init__).parameters


def check_invariants(name: str, phy2log_LP: np.ndarray, weights_LP, load_LE: np.ndarray, topo: Topology) -> None:
    L, E = load_LE.shape
    G, S, P = topo.num_gpus, topo.slots_per_gpu, topo.num_slots
    phy2log_LP = np.asarray(phy2log_LP)
    assert phy2log_LP.shape == (L, P), f"{name}: shape {phy2log_LP.shape}, want {(L, P)}"
    assert np.issubdtype(phy2log_LP.dtype, np.integer)
    assert phy2log_LP.min() >= 0 and phy2log_LP.max() < E, f"{name}: expert id out of range"
    count_LE = np.zeros((L, E), dtype=np.int64)
    np.add.at(count_LE, (np.arange(L)[:, None], phy2log_LP), 1)
    assert count_LE.min() >= 1, f"{name}: an expert has no replica"
    assert count_LE.sum(axis=1).tolist() == [P] * L  # exactly S slots on each of the G GPUs
    if getattr(planner_class(name), "one_replica_per_gpu", True):
        per_gpu = np.sort(phy2log_LP.reshape(L, G, S), axis=2)
        assert not (np.diff(per_gpu, axis=2) == 0).any(), f"{name}: two replicas of one expert on a GPU"
    placement = Placement(phy2log_LP, G, E, topo.num_nodes, dispatch_weights_LP=weights_LP)
    mx_L = placement.gpu_loads(load_LE).max(axis=1)
    lb_L = stats.lower_bound(load_LE, G, P)
    assert (mx_L >= lb_L * (1 - 1e-9) - 1e-9).all(), f"{name}: beats the lower bound: {mx_L} < {lb_L}"


@st.composite
def problems(draw):
    """A small planning problem: loads [L, E] with heavy tails and zeros, and a topology."""
    N = draw(st.sampled_from([1, 1, 2, 4]))
    G = N * draw(st.integers(1, 3))
    E = draw(st.integers(max(G, 2), 24))
    S_min = -(-E // G)
    S = draw(st.integers(S_min, min(S_min + 2, E)))
    L = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["uniform", "pareto", "one_hot", "zeros"]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        load = rng.integers(0, 1000, (L, E)).astype(float)
    elif kind == "pareto":
        load = np.floor(rng.pareto(1.1, (L, E)) * 100)
    elif kind == "one_hot":
        load = np.zeros((L, E))
        load[:, rng.integers(0, E)] = 1000
    else:
        load = np.zeros((L, E))
    divisors = [k for k in range(1, E + 1) if E % k == 0]
    K = draw(st.sampled_from(divisors + [None]))
    return load, Topology(num_gpus=G, slots_per_gpu=S, num_nodes=N), K


@pytest.mark.parametrize("name", PLANNERS)
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(problem=problems())
def test_invariants_property(name, problem):
    load, topo, K = problem
    if is_time_limited(name) and load.shape[1] > 12:
        load = load[:, :12]  # solvers get the smaller half of the shapes
        if topo.num_gpus * topo.slots_per_gpu < 12 or topo.num_gpus > 12:
            return
    request = PlanRequest(load, topo, history_TLE=load[None], num_expert_groups=K)
    planner = get_planner(name, **fast_settings(name))
    try:
        sol = planner.plan(request)
    except EplbError as exc:
        # Refusing is allowed for configurations a planner cannot serve, with a message.
        assert str(exc)
        return
    check_invariants(name, sol.phy2log_LP, sol.dispatch_weights_LP, load, topo)
    if not is_time_limited(name):
        again = get_planner(name, **fast_settings(name)).plan(request)
        assert np.array_equal(sol.phy2log_LP, again.phy2log_LP), f"{name} is not deterministic"


@pytest.mark.parametrize("name", PLANNERS)
def test_invariants_deepseek_like(name):
    """A DeepSeek-V3-like miniature: 4 layers x 64 experts, 8 groups, 16 GPUs on 4 nodes."""
    rng = np.random.default_rng(7)
    load = np.floor(rng.pareto(1.3, (4, 64)) * 1000)
    topo = Topology.for_experts(64, num_gpus=16, num_nodes=4)
    if is_time_limited(name):
        load = load[:1]
    sol = get_planner(name, **fast_settings(name)).plan(PlanRequest(load, topo, history_TLE=load[None],
                                                                    num_expert_groups=8))
    check_invariants(name, sol.phy2log_LP, sol.dispatch_weights_LP, load, topo)


@pytest.mark.parametrize("name", PLANNERS)
def test_plan_front_door_every_planner(name):
    rng = np.random.default_rng(3)
    load = rng.integers(0, 500, (2, 16)).astype(float)
    res = eplb.plan(load, num_gpus=4, num_nodes=2, planner=name, num_expert_groups=4, settings=fast_settings(name))
    assert res.planner == name and res.placement.planner == name
    assert res.success == (res.status != "FALLBACK")
    assert res.placement.num_slots == 20 and res.seconds >= 0
    assert (res.after.bound_ratio_L >= 1 - 1e-9).all()


# Golden: DeepSeek's README example -----------------------------------------------------------

def test_deepseek_readme_example_exact():
    phy2log_LP, log2phy_LEX, count_LE, policy = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert policy == "hierarchical"
    np.testing.assert_array_equal(phy2log_LP, README_PHY2LOG)
    # The derived maps agree with the placement's own.
    placement = Placement(phy2log_LP, 8, 12, 2)
    np.testing.assert_array_equal(count_LE, placement.replica_count_LE)
    for layer in range(2):
        for e in range(12):
            slots = sorted(s for s in log2phy_LEX[layer, e] if s >= 0)
            assert slots == sorted(np.flatnonzero(phy2log_LP[layer] == e).tolist())


def test_deepseek_planner_through_front_door():
    res = eplb.plan(README_WEIGHT, num_gpus=8, num_nodes=2, num_redundant=4, planner="deepseek", num_expert_groups=4)
    np.testing.assert_array_equal(res.placement.phy2log_LP, README_PHY2LOG)
    assert res.info["policy"] == "hierarchical"


@pytest.mark.parametrize("name", ["greedy", "hierarchical"])
def test_readme_example_matched_or_beaten(name):
    ref = eplb.plan(README_WEIGHT, num_gpus=8, num_nodes=2, num_redundant=4, planner="deepseek", num_expert_groups=4)
    res = eplb.plan(README_WEIGHT, num_gpus=8, num_nodes=2, num_redundant=4, planner=name, num_expert_groups=4)
    assert (res.after.gpu_load_LG.max(axis=1) <= ref.after.gpu_load_LG.max(axis=1) + 1e-9).all()
    # The README's layer 0 gives 156 tokens to DeepSeek's busiest GPU; 139 is reachable.
    assert res.after.gpu_load_LG.max(axis=1)[0] <= 139


def test_deepseek_policies_and_refusals():
    # Groups that do not split over nodes: DeepSeek's own rule falls back to global, and says so.
    res = eplb.plan(README_WEIGHT, num_gpus=6, num_nodes=3, num_redundant=6, planner="deepseek", num_expert_groups=4)
    assert res.info["policy"] == "global"
    with pytest.raises(EplbError, match="do not split evenly over 3 nodes"):
        eplb.plan(README_WEIGHT, num_gpus=6, num_nodes=3, num_redundant=6, planner="deepseek", num_expert_groups=4,
                  settings={"policy": "hierarchical"})
    with pytest.raises(EplbError, match="equal (expert )?groups"):  # refused at the front door now
        eplb.plan(README_WEIGHT, num_gpus=8, num_nodes=2, num_redundant=4, planner="deepseek", num_expert_groups=5,
                  settings={"policy": "hierarchical"})
    with pytest.raises(EplbError, match="needs num_expert_groups"):
        eplb.plan(README_WEIGHT, num_gpus=8, num_nodes=2, num_redundant=4, planner="deepseek",
                  settings={"policy": "hierarchical"})
    with pytest.raises(EplbError, match="unknown deepseek policy"):
        get_planner("deepseek", policy="local")


# hierarchical: locality and configurations -----------------------------------------------------

def test_hierarchical_more_local_than_greedy_at_equal_balance():
    rng = np.random.default_rng(11)
    # Skewed groups: group 0 is hot, as on real DeepSeek-V3 layers.
    load = np.floor(rng.pareto(1.5, (6, 64)) * 100) + 1
    load[:, :8] *= 6
    g = eplb.plan(load, num_gpus=16, num_nodes=4, planner="greedy", num_expert_groups=8)
    h = eplb.plan(load, num_gpus=16, num_nodes=4, planner="hierarchical", num_expert_groups=8)
    assert h.info["group_span_mean"] < h.info["greedy_group_span_mean"]
    span = group_span(h.placement.phy2log_LP, h.placement.topology, 8, 64)
    assert span.mean() == pytest.approx(h.info["group_span_mean"])
    assert (h.after.gpu_load_LG.max(1) <= g.after.gpu_load_LG.max(1) * 1.005 + 1e-9).all()


def test_hierarchical_one_node_is_fully_local():
    rng = np.random.default_rng(5)
    load = rng.integers(1, 100, (2, 32)).astype(float)
    res = eplb.plan(load, num_gpus=8, num_nodes=1, planner="hierarchical", num_expert_groups=4)
    assert res.info["group_span_mean"] == 1.0 and res.info["group_span_max"] == 1


def test_hierarchical_configurations_deepseek_rejects():
    rng = np.random.default_rng(2)
    load = rng.integers(1, 100, (2, 24)).astype(float)
    # 8 groups over 3 nodes: works (DeepSeek would fall back to its global policy).
    res = eplb.plan(load, num_gpus=6, num_nodes=3, planner="hierarchical", num_expert_groups=8)
    assert res.success and res.info["num_groups"] == 8
    # No groups: every expert is its own group, and the message says so.
    res = eplb.plan(load, num_gpus=6, num_nodes=3, planner="hierarchical")
    assert res.info["num_groups"] == 24 and "own group" in res.message
    with pytest.raises(EplbError, match="do not split into 5 equal expert groups"):
        eplb.plan(load, num_gpus=6, num_nodes=3, planner="hierarchical", num_expert_groups=5)
    with pytest.raises(EplbError, match="divisible by num_nodes"):
        eplb.plan(load, num_gpus=6, num_nodes=4, planner="hierarchical", num_expert_groups=8)
    with pytest.raises(EplbError, match="tolerance"):
        get_planner("hierarchical", tolerance=-1)


@pytest.mark.parametrize("groups", [None, 1, 4, 8])
def test_hierarchical_node_cut_when_groups_run_out_before_a_node_is_full(groups):
    # 8 GPUs on 4 nodes (2 per node), 4 slots each: expert 1 has 7 replicas; the cut reached
    # node 2 with one slot left that only expert 1 could fill, and node 2 already held 2 of it
    # (one per GPU). The leftover went to the last node: 7 and 9 slots, an AssertionError.
    load = np.array([[1.0, 2, 1, 1, 1, 1, 1, 0]])
    topo = Topology(num_gpus=8, slots_per_gpu=4, num_nodes=4)
    sol = get_planner("hierarchical").plan(PlanRequest(load, topo, num_expert_groups=groups))
    check_invariants("hierarchical", sol.phy2log_LP, None, load, topo)


# Front door ---------------------------------------------------------------------------------

def test_plan_front_door_result():
    load = np.array([[10.0, 0, 0, 0, 5, 5, 5, 5]])
    res = eplb.plan(load, num_gpus=4)
    assert res.planner == "greedy" and res.status == "HEURISTIC" and res.success
    assert res.placement.num_slots == 12  # 8 experts + one redundant slot per GPU
    assert res.lower_bound_L.shape == (1,)
    # The hot expert gets replicas; the busiest GPU is far below contiguous's 10.
    assert res.after.gpu_load_LG.max() < res.before.gpu_load_LG.max()
    summary = res.summary()
    assert summary["num_gpus"] == 4 and summary["after"]["bound_ratio"]["max"] >= 1.0
    assert res.placement.metrics["bound_ratio_max"] == pytest.approx(res.after.bound_ratio_L.max())


def test_plan_front_door_history_and_errors():
    hist = np.stack([np.eye(8)[0] * 100, np.eye(8)[7] * 100])  # [T=2, E=8] -> make it [T, L, E]
    res = eplb.plan(hist[:, None, :], num_gpus=4, aggregate="last")
    np.testing.assert_array_equal(res.load_LE, hist[-1:])
    with pytest.raises(EplbError, match="unknown planner"):
        eplb.plan(hist[:, None, :], num_gpus=4, planner="nope")
    with pytest.raises(EplbError, match="does not take these settings"):
        eplb.plan(hist[:, None, :], num_gpus=4, settings={"bogus": 1})
    with pytest.raises(EplbError, match="non-negative"):
        eplb.plan(-np.ones((1, 8)), num_gpus=4)
    with pytest.raises(EplbError, match="do not\\s+split evenly"):
        eplb.plan(np.ones((1, 8)), num_gpus=3, num_redundant=0)


@pytest.mark.parametrize("name", ["greedy", "contiguous", "robust"])
def test_plan_one_gpu_default_and_too_many_slots(name):
    load = np.arange(1.0, 17.0)[None]
    res = eplb.plan(load, num_gpus=1, planner=name)  # default sizing used to give 17 slots and fail
    assert res.placement.num_slots == 16
    # Checked before any [L, P] array is allocated, with the fix in the message.
    with pytest.raises(EplbError, match="use at most 16 slots per GPU"):
        eplb.plan(load, num_gpus=4, num_redundant=10**9, planner=name)


@pytest.mark.parametrize("name, settings, message", [
    ("greedy", {"refine_rounds": 1.5}, "refine_rounds must be a whole number"),  # was truncated to 1
    ("greedy", {"refine_rounds": True}, "refine_rounds must be a whole number"),
    ("robust", {"refine_rounds": "abc"}, "refine_rounds must be a whole number"),  # was a traceback
    ("robust", {"quantile": "abc"}, "wrong type"),
    ("hierarchical", {"refine_rounds": -1}, "whole number >= 0"),
    ("greedy", {"refine_gap": 1.0}, r"refine_gap must be a number in \[0, 1\), got 1.0"),
    ("greedy", {"refine_gap": "abc"}, "refine_gap must be a number"),
])
def test_planner_settings_of_the_wrong_type_are_refused(name, settings, message):
    with pytest.raises(EplbError, match=message):
        get_planner(name, **settings)
    assert get_planner(name, refine_rounds=3.0).refine_rounds == 3  # --set refine_rounds=3.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_gpus=2.5), "num_gpus must be a positive integer, got 2.5"),
    (dict(num_gpus="4"), "num_gpus must be a positive integer, got '4'"),
    (dict(num_gpus=4, num_redundant=4.7), "num_redundant must be a whole number, got 4.7"),
    (dict(num_gpus=4, slots_per_gpu=5.5), "slots_per_gpu must be a whole number, got 5.5"),
])
def test_topology_for_experts_refuses_fractional_sizes(kwargs, message):
    # int() used to truncate them: 2.5 GPUs planned as 2, slots_per_gpu 5.5 as 5.
    with pytest.raises(EplbError, match=message):
        Topology.for_experts(16, **kwargs)
    assert Topology.for_experts(16, num_gpus=4.0, num_redundant=4.0) == Topology(4, 5)


def test_plan_previous_of_other_shape_names_the_fix():
    load = np.arange(1.0, 17.0)[None]
    old = eplb.plan(load, num_gpus=4).placement
    with pytest.raises(EplbError, match=r"num_gpus=4, slots_per_gpu=5"):
        eplb.plan(load, num_gpus=8, slots_per_gpu=5, previous=old)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_gpus=2.5), r"num_gpus must be a whole number >= 1, got 2.5"),  # was planned for 2 GPUs
    (dict(num_gpus="4"), r"num_gpus must be a whole number >= 1, got '4'"),
    (dict(num_gpus=4, slots_per_gpu=4.5), r"slots_per_gpu must be a whole number >= 0, got 4.5"),  # was 4
    (dict(num_gpus=4, num_redundant="4"), r"num_redundant must be a whole number >= 0, got '4'"),
    (dict(num_gpus=4, num_nodes=2, planner="hierarchical", num_expert_groups=2.5),
     r"num_expert_groups must be a whole number >= 1"),
    (dict(num_gpus=4, num_expert_groups=0), r"num_expert_groups must be a whole number >= 1, got 0"),
    (dict(num_gpus=4, num_expert_groups=3), r"16 experts do not split into 3 equal expert groups"),  # greedy ignored it
    (dict(num_gpus=4, settings=["quantile=0.9"]), r"settings must be a dict of planner settings"),  # was a TypeError
    (dict(num_gpus=4, previous="old.json"), r"previous must be a Placement.*load_placement"),  # was an AttributeError
])
def test_plan_front_door_refuses_arguments_of_the_wrong_type(kwargs, message):
    with pytest.raises(EplbError, match=message):
        eplb.plan(np.arange(1.0, 17.0)[None], **kwargs)
    assert eplb.plan(np.arange(1.0, 17.0)[None], num_gpus=4.0, slots_per_gpu=np.int64(5)).placement.num_slots == 20


def test_plan_front_door_refuses_ragged_loads():
    with pytest.raises(EplbError, match="rectangular array of numbers"):  # was a bare numpy ValueError
        eplb.plan([[1.0, 2.0], [3.0]], num_gpus=1)


@pytest.mark.parametrize("kwargs", [dict(span_cost=2.0), dict(bytes_per_expert=100)])
def test_plan_migration_options_without_previous_are_refused(kwargs):
    """Like max_moves: an option that only prices migration must not be ignored silently."""
    name = next(iter(kwargs))
    with pytest.raises(EplbError, match=rf"{name} \({kwargs[name]!r}\).*previous"):
        eplb.plan(np.arange(1.0, 17.0)[None], num_gpus=4, budget=eplb.Budget(**kwargs))


def test_a_negative_span_cost_is_refused_by_the_budget():
    """span_cost=-1.0 was refused by plan() for want of a previous placement; the Budget value refuses it first."""
    with pytest.raises(EplbError, match=r"span_cost must be a finite number >= 0, got -1.0"):
        eplb.Budget(span_cost=-1.0)


def test_unknown_setting_is_named_with_the_known_ones():
    with pytest.raises(EplbError, match=r"does not take these settings: 'gap'; its settings are time_limit, "):
        get_planner("ilp", gap=2, quiet=True)  # quiet is the CLI's, not the user's: not in the message
    with pytest.raises(EplbError, match=r"'bogus'; its settings are refine_rounds, refine_gap$"):
        get_planner("greedy", bogus=1)
