"""The per-batch time dispatch (eplb.dispatch.timed) and the traffic-aware planner."""

from __future__ import annotations

import numpy as np
import pytest

import eplb
from eplb.core.placement import Placement
from eplb.core.trace import Trace
from eplb.dispatch.cost import cost_model, slot_rows, step_cost
from eplb.dispatch.rules import get_rule
from eplb.dispatch.timed import TimeDispatch
from eplb.errors import EplbError
from eplb.evaluate.simulate import get_dispatch
from planners.traffic import colocate_layer

COST = cost_model("deepseek-v3", "h200")


def _placement(seed=0, L=4, E=256, G=16, redundant=32, nodes=1):
    rng = np.random.default_rng(seed)
    load = np.floor(rng.pareto(1.0, (L, E)) * 100) + 1
    return eplb.plan(load, num_gpus=G, num_nodes=nodes, num_redundant=redundant).placement, load


def _batches(load, B, n, seed=1, K=8):
    rng = np.random.default_rng(seed)
    return [rng.multinomial(B * K, load / load.sum(axis=1, keepdims=True)).astype(float) for _ in range(n)]


def test_shares_are_valid_and_rows_whole():
    p, load = _placement()
    td = TimeDispatch(COST).bind(p)
    for counts in _batches(load, 32, 5) + _batches(load, 4096, 2):
        w = td(counts)
        sums = np.zeros_like(counts)
        np.add.at(sums, (np.arange(p.num_layers)[:, None], p.phy2log_LP), w)
        np.testing.assert_allclose(sums, 1.0)
        assert w.min() >= 0
        rows = slot_rows(p, counts, w)
        np.testing.assert_allclose(rows, np.rint(rows))
        np.testing.assert_allclose(rows.sum(axis=1), counts.sum(axis=1))


def test_small_batches_wake_fewer_replicas_and_lower_the_busiest_gpu():
    p, load = _placement()
    td, even = TimeDispatch(COST).bind(p), get_rule("even").bind(p)
    busiest = {"even": [], "time": []}
    for counts in _batches(load, 32, 20):
        steps = {name: step_cost(COST, p, slot_rows(p, counts, bound(counts)), 32)
                 for name, bound in (("even", even), ("time", td))}
        assert steps["time"].active_LG.sum() <= steps["even"].active_LG.sum()
        for name, s in steps.items():
            busiest[name].append(s.busiest_compute_seconds)
    assert np.mean(busiest["time"]) < 0.95 * np.mean(busiest["even"])
    assert max(t / e for t, e in zip(busiest["time"], busiest["even"])) <= 1.0


def test_compute_bound_batches_split_hot_experts():
    """In prefill an expert with thousands of rows is split over its replicas, as the token
    re-split would; a 1-token decode batch sends each expert to one replica."""
    p = Placement(np.array([[0, 1, 0, 2]]), 2, 3)                  # expert 0 on both GPUs
    td = TimeDispatch(COST).bind(p)
    w = td(np.array([[20000.0, 10.0, 10.0]]))
    assert 0.3 < w[0, 0] < 0.7 and 0.3 < w[0, 2] < 0.7
    w = td(np.array([[1.0, 1.0, 0.0]]))
    assert sorted(w[0, [0, 2]].tolist()) == [0.0, 1.0]
    assert w[0, 2] == 1.0                                           # GPU 1 holds nothing else that is busy


def test_time_rule_contract():
    p, _ = _placement(L=1)
    with pytest.raises(EplbError, match="pass counts"):
        TimeDispatch(COST).bind(p)(None)
    with pytest.raises(EplbError, match=r"counts have shape \(2, 256\).*\(1, 256\)"):
        TimeDispatch(COST).bind(p)(np.ones((2, 256)))
    with pytest.raises(EplbError, match="needs a CostModel"):
        TimeDispatch("h200").bind(p)
    assert get_dispatch("time", COST).name == "time" and get_dispatch("even", COST).name == "even"
    with pytest.raises(EplbError, match="unknown dispatch rule 'fast'.*time"):
        get_dispatch("fast", COST)


# Traffic-aware placement ----------------------------------------------------------------------------


def _clustered_tokens(E=32, clusters=8, K=4, N=3000, L=2, seed=0):
    """Tokens that pick all K experts inside one of `clusters` groups of experts (shuffled ids)."""
    rng = np.random.default_rng(seed)
    size = E // clusters
    ids = np.empty((N, L, K), dtype=np.int64)
    for l in range(L):
        perm = rng.permutation(E).reshape(clusters, size)
        c = rng.integers(0, clusters, N)
        ids[:, l] = np.stack([rng.choice(perm[ci], K, replace=False) for ci in c])
    counts = np.stack([np.bincount(ids[:, l].ravel(), minlength=E) for l in range(L)])[None]
    meta = {"model": None, "num_hidden_layers": L, "num_experts": E, "top_k": K, "num_expert_groups": None,
            "tokens_per_window": N, "source": "test", "synthetic": True}
    return Trace(counts, np.arange(L), meta, ids, np.zeros(N, dtype=np.int32))


def _distinct_gpus(placement, ids_NLK):
    gpu_LP = np.broadcast_to(placement.gpu_of_slot(), placement.phy2log_LP.shape)
    out = []
    for l in range(placement.num_layers):
        gpu_E = np.empty(placement.num_logical_experts, dtype=np.int64)
        gpu_E[placement.phy2log_LP[l]] = gpu_LP[l]
        s = np.sort(gpu_E[ids_NLK[:, l]], axis=1)
        out.append((1 + (np.diff(s, axis=1) != 0).sum(axis=1)).mean())
    return np.array(out)


def test_traffic_planner_keeps_co_activated_experts_together():
    trace = _clustered_tokens()
    greedy = eplb.plan(trace, num_gpus=8, num_nodes=2, slots_per_gpu=4, planner="greedy")
    traffic = eplb.plan(trace, num_gpus=8, num_nodes=2, slots_per_gpu=4, planner="traffic",
                        settings={"tolerance": 0.05})
    assert traffic.status == greedy.status and traffic.info["swaps"] > 0
    ids = np.asarray(trace.topk_ids_NLK, dtype=np.int64)
    assert (_distinct_gpus(traffic.placement, ids) < 0.8 * _distinct_gpus(greedy.placement, ids)).all()
    # Balance: within the tolerance of the base plan's busiest GPU, layer by layer.
    load = trace.total().astype(float)
    assert (traffic.placement.gpu_loads(load).max(axis=1)
            <= 1.05 * greedy.placement.gpu_loads(load).max(axis=1) + 1e-9).all()


def test_colocate_layer_never_adds_distinct_gpus_and_keeps_a_valid_map():
    trace = _clustered_tokens(E=16, clusters=4, K=3, N=800, L=1, seed=3)
    ids = np.asarray(trace.topk_ids_NLK[:, 0], dtype=np.int64)
    start = eplb.plan(trace, num_gpus=4, slots_per_gpu=5, planner="greedy").placement
    before = _distinct_gpus(start, ids[:, None])[0]
    out, swaps = colocate_layer(start.phy2log_LP[0], ids, trace.total()[0].astype(float), 4, 0.1, 100)
    after_p = Placement(out[None], 4, 16)
    assert sorted(set(out.tolist())) == list(range(16))
    assert all(len(set(out[g * 5:(g + 1) * 5].tolist())) == 5 for g in range(4))
    assert swaps > 0 and _distinct_gpus(after_p, ids[:, None])[0] <= before


def test_traffic_planner_without_tokens_says_it_fell_back():
    res = eplb.plan(np.arange(1, 33, dtype=float)[None], num_gpus=4, planner="traffic")
    assert res.status == "FALLBACK" and not res.success and "no per-token expert choices" in res.message
    with pytest.raises(EplbError, match="tolerance must be a number in"):
        eplb.plan(np.ones((1, 8)), num_gpus=2, planner="traffic", settings={"tolerance": 2})


@pytest.mark.parametrize("B, nodes", [(1, 1), (16, 1), (16, 2), (256, 1), (256, 2), (4096, 1)])
def test_never_worse_than_the_even_split_in_any_layer(B, nodes):
    p, load = _placement(seed=B, L=6, G=8, redundant=24, nodes=nodes)
    td, even = TimeDispatch(COST).bind(p), get_rule("even").bind(p)
    for counts in _batches(load, B, 4, seed=B):
        t = step_cost(COST, p, slot_rows(p, counts, td(counts)), B)
        e = step_cost(COST, p, slot_rows(p, counts, even(counts)), B)
        assert (t.compute_s_LG.max(axis=1) <= e.compute_s_LG.max(axis=1) * (1 + 1e-9)).all()
        # ... and in the whole modeled step: rows gathered on fewer replicas gather the
        # all-to-all onto fewer GPUs, which can cost more than the weight streams saved.
        assert (t.layer_s_L <= e.layer_s_L * (1 + 1e-9)).all()


def _shuffled_placement(seed, L=3, E=64, G=8, S=10, nodes=2):
    """Random slots with second copies of an expert on one GPU (no planner makes these)."""
    rng = np.random.default_rng(seed)
    phy = np.stack([rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, G * S - E)]))
                    for _ in range(L)])
    return Placement(phy, G, E, num_nodes=nodes)


@pytest.mark.parametrize("seed", range(4))
def test_shuffled_placements_with_second_copies_keep_valid_shares_and_the_even_floor(seed):
    """Random slots with second copies of an expert on one GPU, one and two nodes, whole rows
    from 1-token to prefill batches and fractional counts: shares sum to 1 per expert and no
    layer's busiest GPU is modeled slower than under the even split."""
    rng = np.random.default_rng(seed)
    p = _shuffled_placement(seed)
    load = rng.gamma(0.3, 1.0, (3, 64)) + 0.01
    td, even = TimeDispatch(COST).bind(p), get_rule("even").bind(p)
    for B in (1, 8, 32, 128, 4096):
        for counts in _batches(load, B, 3, seed=seed + B):
            for c in (counts, counts * 0.37):
                w = td(c)
                sums = np.zeros_like(c)
                np.add.at(sums, (np.arange(p.num_layers)[:, None], p.phy2log_LP), w)
                np.testing.assert_allclose(sums, 1.0)
                assert w.min() >= 0
                t = step_cost(COST, p, slot_rows(p, c, w), B)
                e = step_cost(COST, p, slot_rows(p, c, even(c)), B)
                assert (t.compute_s_LG.max(axis=1) <= e.compute_s_LG.max(axis=1) * (1 + 1e-9)).all()


def test_a_second_copy_on_one_gpu_does_not_hide_the_expert_on_another():
    """Expert 0 has two slots on GPU 0 and one on GPU 1: with GPU 0 busy, its row goes to GPU 1."""
    p = Placement(np.array([[0, 0, 1, 2, 0, 3]]), 2, 4)
    w = TimeDispatch(COST).bind(p)(np.array([[1.0, 200.0, 0.0, 0.0]]))
    assert w[0].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("seed", range(6))
def test_shares_are_the_plain_references(seed):
    """TimeSolver's per-batch steps give tests/oracles/timed.py's shares, bit for bit: planned and
    shuffled placements (second copies on one GPU), one to four nodes, barrier and overlap, whole
    and fractional counts from 1-token to prefill batches."""
    from eplb.dispatch.timed import TimeSolver
    from tests.oracles.timed import ReferenceTimeSolver

    rng = np.random.default_rng(seed)
    cost = cost_model("deepseek-v3", "h200", overlap=bool(seed % 2))
    if seed % 3 == 0:
        p = _shuffled_placement(seed, nodes=2)
        load = rng.gamma(0.3, 1.0, (3, 64)) + 0.01
    else:
        p, load = _placement(seed, L=4, G=16, redundant=16 * (seed % 3), nodes=[1, 2, 4][seed % 3])
    fast, ref = TimeSolver(p, cost), ReferenceTimeSolver(p, cost)
    for B in (1, 3, 16, 64, 512, 4096):
        for counts in _batches(load, B, 2, seed=seed + B):
            for c in (counts, counts * 0.37):
                np.testing.assert_array_equal(fast(c), ref(c))
    np.testing.assert_array_equal(fast(np.zeros_like(load)), ref(np.zeros_like(load)))
