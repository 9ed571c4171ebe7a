"""Migration: move counting, relabelling, budgeted plans, safe schedules (eplb.migration)."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb import EplbError, Placement, plan, planner_names
from eplb import migration as mg
from eplb.migration.moves import _gpu_assignment, _keep_counts
from tests.oracles import migration as oracle


def relay_schedule(old_LP, new_LP, G, E, *, layers_per_chunk=None, bytes_per_expert=None):
    """The kernel's relay mode alone (`schedule` runs it only past RELAY_GATE x the round bound)."""
    from eplb.migration.schedule.rounds import _scheduled, check_schedule_input

    old, new, chunk, ranks = check_schedule_input(old_LP, new_LP, G, E, layers_per_chunk, None)
    return _scheduled(old, new, G, E, chunk, ranks, bytes_per_expert, False, relay=True)


# The compiled schedule (and its relay mode alone) and its Python reference: every schedule test runs on each.
SCHEDULERS = pytest.mark.parametrize("scheduler", [mg.schedule, relay_schedule, oracle.schedule],
                                     ids=["compiled", "relay", "python"])


def random_map(rng, L, G, S, E):
    """Random phy2log [L, G*S] holding every expert at least once per layer."""
    rows = []
    for _ in range(L):
        extra = rng.integers(0, E, G * S - E)
        rows.append(rng.permutation(np.concatenate([np.arange(E), extra])))
    return np.stack(rows)


# Counting -------------------------------------------------------------------------------------

def test_count_moves_ignores_slot_swaps_inside_a_gpu():
    old = np.array([[0, 1, 2, 3]])              # GPU0 {0,1}, GPU1 {2,3}
    same_gpus = np.array([[1, 0, 3, 2]])
    assert mg.count_moves(old, same_gpus, 2, 4).sum() == 0
    one_each_way = np.array([[0, 2, 1, 3]])     # 2 -> GPU0, 1 -> GPU1
    assert mg.count_moves(old, one_each_way, 2, 4).tolist() == [[1, 1]]


# Relabelling ----------------------------------------------------------------------------------

def test_relabel_undoes_a_renaming_of_gpus_and_slots(rng):
    L, G, S, E = 3, 4, 3, 10
    old = random_map(rng, L, G, S, E)
    new = np.empty_like(old)
    for l in range(L):
        gperm = rng.permutation(G)
        for b, a in enumerate(gperm):
            new[l, b * S:(b + 1) * S] = rng.permutation(old[l, a * S:(a + 1) * S])
    perm = mg.relabel(old, new, G, E)
    assert np.array_equal(np.take_along_axis(new, perm, axis=1), old)


def test_relabel_moves_nodes_as_wholes(rng):
    L, G, S, E, N = 2, 4, 2, 6, 2
    old = random_map(rng, L, G, S, E)
    new = np.concatenate([old[:, 4:], old[:, :4]], axis=1)    # nodes swapped
    perm = mg.relabel(old, new, G, E, num_nodes=N)
    rel = np.take_along_axis(new, perm, axis=1)
    assert np.array_equal(rel, old)
    # Every GPU's set of experts comes from one GPU of the new plan on one node.
    for l in range(L):
        src_gpu = perm[l].reshape(G, S) // S
        assert (src_gpu == src_gpu[:, :1]).all()
        src_node = src_gpu[:, 0] // (G // N)
        assert (src_node.reshape(N, -1) == src_node.reshape(N, -1)[:, :1]).all()


@pytest.mark.parametrize("num_nodes", [1, 2, 4])
def test_compiled_gpu_assignment_keeps_as_much_as_scipys(num_nodes):
    """Same kept total per layer as scipy's linear_sum_assignment (ties may pick other GPUs),
    and every assignment a permutation that moves nodes as wholes."""
    rng = np.random.default_rng(num_nodes)
    L, G = 20, 8
    keep = rng.integers(0, 4, (L, G, G)).astype(float)    # small integers: many ties
    fast = _gpu_assignment(keep, num_nodes)
    ref = oracle.gpu_assignment(keep, num_nodes)
    kept = lambda out: keep[np.arange(L)[:, None], out, np.arange(G)[None, :]].sum(axis=1)  # noqa: E731
    np.testing.assert_array_equal(kept(fast), kept(ref))
    n = G // num_nodes
    assert (np.sort(fast, axis=1) == np.arange(G)).all()
    assert (fast.reshape(L, num_nodes, n) // n == (fast.reshape(L, num_nodes, n) // n)[:, :, :1]).all()


@pytest.mark.parametrize("S, E", [(2, 120), (3, 40), (5, 200)])
def test_sparse_gpu_matching_keeps_as_much_as_the_dense_one(monkeypatch, S, E):
    """Many GPUs match on their overlap pairs alone (scipy's sparse matcher): the same kept
    total per layer as the Hungarian method on the full matrix, a renaming undone exactly."""
    from eplb.migration import moves

    rng = np.random.default_rng(S)
    L, G = 4, 100
    old, new = random_map(rng, L, G, S, E), random_map(rng, L, G, S, E)
    new[0] = old[0].reshape(G, S)[rng.permutation(G)].ravel()
    # Layer 1: half the GPUs renamed among themselves, the other half holding only experts the
    # old layer lacks (GPUs without an overlap pair: the matcher's dummy completion places them).
    half = G // 2
    old[1] = rng.integers(0, E // 2, G * S)
    ideal = old[1].copy()
    ideal[half * S:] = rng.integers(E // 2, E, (G - half) * S)
    new[1] = ideal.reshape(G, S)[np.concatenate([rng.permutation(half), rng.permutation(G - half) + half])].ravel()
    monkeypatch.setattr(moves, "SPARSE_FROM_GPUS", 10**9)
    dense = np.take_along_axis(new, mg.relabel(old, new, G, E), axis=1)
    monkeypatch.setattr(moves, "SPARSE_FROM_GPUS", 1)
    sparse = np.take_along_axis(new, mg.relabel(old, new, G, E), axis=1)
    np.testing.assert_array_equal(mg.count_moves(old, sparse, G, E).sum(axis=1),
                                  mg.count_moves(old, dense, G, E).sum(axis=1))
    np.testing.assert_array_equal(sparse[0], old[0])
    assert mg.count_moves(old[1:2], sparse[1:2], G, E).sum() == mg.count_moves(old[1:2], ideal[None], G, E).sum()
    assert (np.sort(sparse, axis=1) == np.sort(new, axis=1)).all()


def test_relabel_is_optimal_against_brute_force(rng):
    L, G, S, E = 4, 4, 2, 6
    old, new = random_map(rng, L, G, S, E), random_map(rng, L, G, S, E)
    rel = np.take_along_axis(new, mg.relabel(old, new, G, E), axis=1)
    got = mg.count_moves(old, rel, G, E).sum(axis=1)
    for l in range(L):
        best = min(
            mg.count_moves(old[l:l + 1], new[l:l + 1].reshape(G, S)[list(p)].reshape(1, -1), G, E).sum()
            for p in itertools.permutations(range(G)))
        assert got[l] == best


def test_relabel_keeps_balance_and_dispatch_weights(rng):
    load = rng.gamma(0.7, 100.0, (3, 32))
    prev = plan(load[::-1].copy(), num_gpus=4, num_redundant=8).placement
    fresh = plan(load, num_gpus=4, num_redundant=8)
    adapted = plan(load, num_gpus=4, num_redundant=8, previous=prev)
    assert np.allclose(np.sort(adapted.after.gpu_load_LG, axis=1), np.sort(fresh.after.gpu_load_LG, axis=1))
    mig = adapted.info["migration"]
    assert mig["method"] == "relabel"
    assert mig["moves"] == mig["moves_relabeled"] <= mig["moves_from_scratch"]


# Budgeted planning ----------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_compiled_keep_slots_and_count_moves_match_the_numpy_reference(seed):
    """Rows with repeated experts and empty slots (-1): same permutation, move counts, overlap
    matrix and holdings as the reference."""
    rng = np.random.default_rng(seed)
    L, G, S, E = (int(v) for v in rng.integers(1, 6, 4))
    old, new = rng.integers(-1, E + 1, (2, L, G * S))
    perm = mg.keep_slots(old, new, G)
    np.testing.assert_array_equal(perm, oracle.keep_slots(old, new, G))
    assert (np.sort(perm, axis=1) == np.arange(G * S)).all()
    np.testing.assert_array_equal(mg.count_moves(old, new, G, E + 1),
                                  oracle.count_moves(old, new, G, E + 1))
    np.testing.assert_array_equal(_keep_counts(old, new, G, E + 1), oracle.keep_counts(old, new, G, E + 1))
    from eplb.migration import _search_kernel

    np.testing.assert_array_equal(_search_kernel.holdings_LEG(new, G, E + 1),
                                  mg.holdings(new, G, E + 1).transpose(0, 2, 1))


BUDGETS = [mg.Budget(), mg.Budget(move_cost=0.001), mg.Budget(max_moves=9), mg.Budget(max_moves_per_gpu=2),
           mg.Budget(max_moves=40, max_moves_per_gpu=3, move_cost=0.002), mg.Budget(max_moves=0)]


@pytest.mark.parametrize("shape", [(4, 16, 4, 5), (3, 64, 8, 9), (2, 256, 32, 9)])
@pytest.mark.parametrize("integer_loads", [False, True])
def test_compiled_search_matches_the_numpy_reference(shape, integer_loads):
    """The numba kernel must make exactly the reference's choices, ties included (integer
    loads tie often), for every kind of budget; (2, 256, 32, 9) is two DeepSeek-V3 layers."""
    L, E, G, S = shape
    rng = np.random.default_rng(E + integer_loads)
    old = random_map(rng, L, G, S, E)
    if integer_loads:
        load = rng.integers(0, 5, (L, E)).astype(float)
    else:
        load = rng.gamma(0.6, 1.0, (L, E)) * rng.integers(1, 100, (L, 1))
    changed = 0
    for budget in BUDGETS:
        ref = oracle.budgeted_search(load, old, G, budget)
        fast = mg.budgeted_search(load, old, G, budget)
        np.testing.assert_array_equal(fast, ref, err_msg=f"{budget}")
        changed += int((ref != old).any())
    assert changed >= 4                          # the searches did make changes to compare


def test_compiled_search_matches_the_reference_on_a_deepseek_plan():
    """DeepSeek-shaped: start from a greedy plan of other loads, unlimited and capped budgets."""
    rng = np.random.default_rng(7)
    L, E, G, R = 3, 256, 32, 32
    skew = rng.gamma(0.4, 1.0, (L, E))
    old = plan(skew * 1000, num_gpus=G, num_redundant=R).placement.phy2log_LP
    load = (skew * rng.gamma(2.0, 0.5, (L, E))) * 1000
    for budget in [mg.Budget(move_cost=0.001), mg.Budget(max_moves=50), mg.Budget(max_moves_per_gpu=1)]:
        ref = oracle.budgeted_search(load, old, G, budget)
        np.testing.assert_array_equal(mg.budgeted_search(load, old, G, budget), ref, err_msg=f"{budget}")
        assert mg.count_moves(old, ref, G, E).sum() > 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), budget=st.integers(0, 12), per_gpu=st.one_of(st.none(), st.integers(0, 3)))
def test_budgeted_search_respects_budget_and_never_worsens(seed, budget, per_gpu):
    rng = np.random.default_rng(seed)
    L, G, S, E = 3, 4, 3, 10
    old = random_map(rng, L, G, S, E)
    load = rng.gamma(0.5, 100.0, (L, E))
    new = mg.budgeted_search(load, old, G, mg.Budget(max_moves=budget, max_moves_per_gpu=per_gpu))
    moves_LG = mg.count_moves(old, new, G, E)
    assert moves_LG.sum() <= budget
    if per_gpu is not None:
        assert moves_LG.sum(axis=0).max() <= per_gpu
    Placement(new, G, E)                         # every expert keeps a replica
    assert (mg.max_load(load, new, G) <= mg.max_load(load, old, G) * (1 + 1e-12)).all()


def test_move_cost_trades_balance_for_moves(rng):
    load = rng.gamma(0.4, 100.0, (4, 64))
    prev = plan(rng.gamma(0.4, 100.0, (4, 64)), num_gpus=8, num_redundant=8).placement
    moves, imb = [], []
    for cost in (0.0005, 0.2):
        r = plan(load, num_gpus=8, num_redundant=8, previous=prev, budget=mg.Budget(move_cost=cost))
        assert r.info["migration"]["method"] == "budgeted_search"
        moves.append(r.info["migration"]["moves"])
        imb.append(r.after.imbalance_L.mean())
    # A higher price per move buys fewer moves and accepts more imbalance.
    assert moves[0] > moves[1] and imb[0] < imb[1]


def test_every_planner_takes_a_move_budget_through_the_front_door(rng):
    load = rng.gamma(0.5, 100.0, (2, 16))
    prev = plan(rng.gamma(0.5, 100.0, (2, 16)), num_gpus=4, num_redundant=4).placement
    for name in planner_names():
        r = plan(load, num_gpus=4, num_redundant=4, planner=name, previous=prev,
                 budget=mg.Budget(max_moves=3, bytes_per_expert=10))
        mig = r.info["migration"]
        assert mig["moves"] <= 3, name
        assert mig["bytes"] == 10 * mig["moves"]
        assert mg.count_moves(prev.phy2log_LP, r.placement.phy2log_LP, 4, 16).sum() == mig["moves"]


def test_budget_options_need_a_previous_placement(rng):
    with pytest.raises(EplbError, match="previous"):
        plan(rng.random((2, 8)), num_gpus=2, budget=mg.Budget(max_moves=3))
    prev = plan(rng.random((2, 8)), num_gpus=2).placement
    with pytest.raises(EplbError, match="max_moves"):
        plan(rng.random((2, 8)), num_gpus=2, previous=prev, budget=mg.Budget(max_moves=-1))


@pytest.mark.parametrize("kw, message", [
    (dict(max_moves=float("inf")), r"max_moves must be a whole number >= 0 or None, got inf"),  # None is unlimited
    (dict(max_moves_per_gpu=float("nan")), r"max_moves_per_gpu must be a whole number >= 0 or None, got nan"),
    (dict(max_moves=2.5), r"max_moves must be a whole number >= 0 or None, got 2.5"),
    (dict(bytes_per_expert=0), r"bytes_per_expert must be a whole number >= 1 or None, got 0"),
    (dict(move_cost="0.1"), r"move_cost must be a finite number >= 0, got '0.1'"),
    (dict(span_cost=float("inf")), r"span_cost must be a finite number >= 0, got inf"),
])
def test_budget_refuses_values_it_cannot_count_or_price(kw, message):
    with pytest.raises(EplbError, match=message):
        mg.Budget(**kw)


def test_budget_holds_whole_numbers_as_int():
    b = mg.Budget(max_moves=4.0, max_moves_per_gpu=np.int64(2), bytes_per_expert=np.int64(8), move_cost=np.float32(0.5))
    assert (b.max_moves, b.max_moves_per_gpu, b.bytes_per_expert, b.move_cost) == (4, 2, 8, 0.5)
    assert type(b.max_moves) is int and type(b.bytes_per_expert) is int and type(b.move_cost) is float


# Schedules ------------------------------------------------------------------------------------

def replay_and_check(m: mg.MigrationPlan, old, new, G):
    """Independent replay: links, complete sources, and a serving replica for every expert."""
    S = old.shape[1] // G
    cur = old.copy()
    for k in range(m.num_rounds):
        idx = np.flatnonzero(m.round_M == k)
        assert idx.size, f"empty round {k}"
        net = idx[(m.src_rank_M[idx] >= 0) & (m.src_rank_M[idx] != m.dst_rank_M[idx])]
        assert len(set(m.src_rank_M[net])) == len(net), "a rank sends twice in one round"
        assert len(set(m.dst_rank_M[net])) == len(net), "a rank receives twice in one round"
        assert len(set(m.dst_rank_M[idx[m.src_rank_M[idx] == -1]])) == (m.src_rank_M[idx] == -1).sum()
        written = {(m.layer_M[i], m.dst_slot_M[i]) for i in idx}
        assert len(written) == idx.size
        for i in idx:
            l, e, s, p = m.layer_M[i], m.expert_M[i], m.src_slot_M[i], m.dst_slot_M[i]
            assert p // S == m.dst_rank_M[i]
            if s >= 0:
                assert cur[l, s] == e and (l, s) not in written, "source not complete"
        for l in range(old.shape[0]):
            before = set(cur[l][cur[l] >= 0])
            serving = {cur[l, p] for p in range(cur.shape[1]) if (l, p) not in written and cur[l, p] >= 0}
            assert before <= serving, f"round {k}: experts {before - serving} of layer {l} not served"
        phy, w = m.serving(k)
        for (l, p) in written:
            assert w[l, p] == 0
        for i in idx:
            cur[m.layer_M[i], m.dst_slot_M[i]] = m.expert_M[i]
    assert np.array_equal(cur, new)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), G=st.integers(2, 5), S=st.integers(1, 3), L=st.integers(1, 3),
       chunk=st.integers(1, 3), spare=st.integers(1, 4))
@SCHEDULERS
def test_schedule_keeps_every_expert_served(scheduler, seed, G, S, L, chunk, spare):
    """Both schedulers (numba and the Python reference) pass the independent replay."""
    rng = np.random.default_rng(seed)
    E = max(1, G * S - spare)
    old, new = random_map(rng, L, G, S, E), random_map(rng, L, G, S, E)
    m = scheduler(old, new, G, E, layers_per_chunk=chunk)
    replay_and_check(m, old, new, G)
    m.check()
    # Rounds never mix layer chunks, and chunks run in order.
    chunk_of_layer = m.layer_M // chunk
    assert (np.diff(chunk_of_layer) >= 0).all()
    for k in range(m.num_rounds):
        assert len(set(chunk_of_layer[m.round_M == k])) == 1
    assert m.moves == mg.count_moves(old, new, G, E).sum()


@SCHEDULERS
def test_swap_of_only_replicas_is_staged_through_a_spare_slot(scheduler):
    # GPU0 [A, C], GPU1 [B, C] -> GPU0 [B, C], GPU1 [A, C]: A and B have one replica each.
    old = np.array([[0, 2, 1, 2]])
    new = np.array([[1, 2, 0, 2]])
    m = scheduler(old, new, 2, 3)
    replay_and_check(m, old, new, 2)
    assert m.staging_M.sum() == 1
    # The staging copy lands in a slot of C, which keeps its other replica meanwhile.
    i = np.flatnonzero(m.staging_M)[0]
    assert old[0, m.dst_slot_M[i]] == 2
    for k in range(m.num_rounds):
        m.serving_placement(k)                       # valid placements all the way


def test_new_placement_must_keep_every_expert():
    with pytest.raises(EplbError, match="expert 1"):
        mg.schedule(np.array([[0, 1, 2, 0]]), np.array([[0, 2, 2, 0]]), 2, 3)


@SCHEDULERS
def test_cycle_without_spare_slot_is_refused(scheduler):
    old = np.array([[0, 1]])
    new = np.array([[1, 0]])
    with pytest.raises(EplbError, match="no safe migration"):
        scheduler(old, new, 2, 2)


@SCHEDULERS
def test_lost_experts_are_reloaded_from_checkpoint_once(scheduler):
    # Expert 3 has no replica left (its rank failed): one checkpoint read, then a copy.
    old = np.array([[0, 1, 2, 0, 1, 2]])
    new = np.array([[0, 1, 3, 2, 3, 0]])
    m = scheduler(old, new, 2, 4, bytes_per_expert=7)
    assert m.reloads == 1 and (m.expert_M == 3).sum() == 2
    replay_and_check(m, old, new, 2)
    assert m.bytes == 7 * (m.network_mask.sum() + 1)
    with pytest.raises(EplbError, match="expert 3"):
        m.serving_placement(0)


def test_budgeted_plan_schedule_on_a_realistic_shape(rng):
    L, E, G = 4, 64, 8
    a = rng.gamma(0.4, 100.0, (L, E))
    b = rng.gamma(0.4, 100.0, (L, E))
    prev = plan(a, num_gpus=G, num_redundant=8).placement
    r = plan(b, num_gpus=G, num_redundant=8, previous=prev, budget=mg.Budget(max_moves=20))
    for scheduler in (mg.schedule, oracle.schedule):
        m = scheduler(prev.phy2log_LP, r.placement.phy2log_LP, G, E, layers_per_chunk=2)
        replay_and_check(m, prev.phy2log_LP, r.placement.phy2log_LP, G)
        assert m.moves <= 20


def test_real_calls_reach_the_kernels_with_one_argument_type_list():
    """Read-only Placement arrays, int32 maps, float32 and non-contiguous loads all reach the
    kernels as one type list each: one cache entry, and no first call with new types (which
    would run as Python until it compiled, eplb.core.jit) after the first decision."""
    from eplb.migration import _moves_kernel, _search_kernel
    from eplb.migration.schedule import _rounds_kernel
    from eplb.serving.rebalance import Rebalancer

    rng = np.random.default_rng(3)
    load = rng.gamma(0.5, 1.0, (3, 64)) * 100
    pl = plan(load, num_gpus=8, num_redundant=8).placement
    assert not pl.phy2log_LP.flags.writeable
    rb = Rebalancer(pl, budget=mg.Budget(move_cost=0.001))
    rb.observe(load[:, ::-1].copy())
    rb.rebalance()
    relay_schedule(pl.phy2log_LP, pl.phy2log_LP[:, ::-1], 8, 64)
    mg.budgeted_search(np.asfortranarray(load.astype(np.float32)), pl.phy2log_LP.astype(np.int32), 8,
                       mg.Budget(max_moves=5))
    mg.relabel(pl.phy2log_LP.astype(np.int32), pl.phy2log_LP[:, ::-1], 8, 64)
    kernels = [_search_kernel.search, _search_kernel.holdings_LEG, _moves_kernel.keep_slots,
               _moves_kernel.count_moves, _moves_kernel.keep_counts, _moves_kernel.gpu_assignment,
               _rounds_kernel.schedule, _rounds_kernel.schedule_relay]
    assert {k.name: len(k._state) for k in kernels} == {k.name: 1 for k in kernels}


_OLD = np.array([[0, 1, 2, 0], [0, 1, 2, 2]])
_NEW = np.array([[1, 0, 2, 1], [2, 1, 0, 0]])


@pytest.mark.parametrize("call, match", [
    (lambda: mg.count_moves(_OLD, _NEW, 2, 2), "old_LP holds expert 2 in slot 2"),
    (lambda: mg.count_moves(_OLD, _NEW[:, :2], 2, 3), "new_LP has shape"),
    (lambda: mg.relabel(_OLD, np.array([[1, 0, 7, 1], [2, 1, 0, 0]]), 2, 3), "expert 7"),
    (lambda: mg.keep_slots(_OLD, _NEW[:1], 2), "same layers and slots"),
    (lambda: mg.budgeted_search(np.ones((3, 3)), _OLD, 2, mg.Budget()), "load must be"),
    (lambda: mg.budgeted_search(np.full((2, 3), np.nan), _OLD, 2, mg.Budget()), "finite"),
    (lambda: mg.schedule(np.array([[0, 1, 9, 0]]), np.array([[0, 1, 2, 0]]), 2, 3), "expert 9"),
    (lambda: mg.schedule(_OLD, _NEW, 3, 3), "do not split evenly over 3 GPUs"),
    (lambda: mg.schedule(_OLD + 0.5, _NEW, 2, 3), "whole expert ids"),
    (lambda: mg.schedule(_OLD, _NEW, 0, 3), "num_gpus must be"),
])
def test_bad_maps_are_refused_before_any_kernel_runs(call, match):
    """The numba kernels index by expert id without bounds checks: bad maps must stop here."""
    with pytest.raises(EplbError, match=match):
        call()


def _two_node_case(seed=5, L=4, E=64, G=8, N=2, K=8):
    """A node-aware (hierarchical) plan served for one load while traffic shifts to another."""
    rng = np.random.default_rng(seed)
    a, b = rng.gamma(0.4, 100.0, (2, L, E))
    prev = plan(a, num_gpus=G, num_nodes=N, num_redundant=G, planner="hierarchical", num_expert_groups=K).placement
    return prev, b, G, N, K, E


def test_span_cost_prices_spreading_groups_over_nodes():
    from eplb.stats.loads import group_span

    prev, load, G, N, K, E = _two_node_case()
    old = prev.phy2log_LP
    pairs = lambda phy: group_span(phy, prev.topology, K, E).sum(axis=1)  # noqa: E731
    runs = {c: mg.budgeted_search(load, old, G, mg.Budget(move_cost=0.001, span_cost=c), num_nodes=N,
                                  num_expert_groups=K)
            for c in (0.0, 1.0, 1e6)}
    # span_cost 0 is the node-blind search, to the slot.
    np.testing.assert_array_equal(runs[0.0], mg.budgeted_search(load, old, G, mg.Budget(move_cost=0.001)))
    # A prohibitive price: no layer gains a (group, node) pair; a unit price: fewer than blind.
    assert (pairs(runs[1e6]) <= pairs(old)).all()
    assert pairs(runs[1.0]).sum() < pairs(runs[0.0]).sum()
    for phy in runs.values():
        Placement(phy, G, E)                                  # every expert keeps a replica
        assert (mg.max_load(load, phy, G) <= mg.max_load(load, old, G) * (1 + 1e-12)).all()
    # Budgets still bind with a span price.
    capped = mg.budgeted_search(load, old, G, mg.Budget(max_moves=7, span_cost=1.0), num_nodes=N, num_expert_groups=K)
    assert mg.count_moves(old, capped, G, E).sum() <= 7


def test_span_cost_reaches_the_search_through_plan_and_rebalancer():
    from eplb.serving.rebalance import Rebalancer
    from eplb.stats.loads import group_span

    prev, load, G, N, K, E = _two_node_case(seed=9)
    span = lambda pl: group_span(pl.phy2log_LP, pl.topology, K, E).mean()  # noqa: E731
    kw = dict(num_gpus=G, num_nodes=N, num_redundant=G, previous=prev, num_expert_groups=K)
    blind, aware = (plan(load, budget=mg.Budget(move_cost=0.001, span_cost=c), **kw).placement for c in (0.0, 4.0))
    assert span(aware) < span(blind)
    rb = Rebalancer(prev, num_expert_groups=K, budget=mg.Budget(span_cost=4.0, move_cost=0.001), policy=None)
    rb.observe(load)
    assert span(rb.rebalance().placement) == pytest.approx(span(aware))
    with pytest.raises(EplbError, match="span_cost"):
        mg.Budget(span_cost=-1.0)
    with pytest.raises(EplbError, match="num_expert_groups"):
        Rebalancer(prev, num_expert_groups=7)
    # The numpy reference prices group span as the kernel does, to the slot.
    for budget in (mg.Budget(move_cost=0.001), mg.Budget(max_moves=9, span_cost=4.0)):
        np.testing.assert_array_equal(
            mg.budgeted_search(load, prev.phy2log_LP, G, budget, num_nodes=N, num_expert_groups=K),
            oracle.budgeted_search(load, prev.phy2log_LP, G, budget, num_nodes=N, num_expert_groups=K))
