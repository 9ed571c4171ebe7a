"""Migration review: bad input at every public entry point, schedule stress, span accounting."""

import numpy as np
import pytest

from eplb import EplbError
from eplb import migration as mg
from eplb.core.topology import Topology
from tests.oracles import migration as oracle
from tests.unit.test_migration import relay_schedule

# Each compiled entry point beside its reference (tests/oracles/migration.py).
SEARCHES = (mg.budgeted_search, oracle.budgeted_search)
SCHEDULERS = (mg.schedule, relay_schedule, oracle.schedule)

_OLD = np.array([[0, 1, 2, 0], [0, 1, 2, 2]])
_NEW = np.array([[1, 0, 2, 1], [2, 1, 0, 0]])
_LOAD = np.array([[3.0, 1.0, 1.0], [1.0, 1.0, 3.0]])
_TOPO = Topology(2, 2)                                  # the maps above: 2 GPUs x 2 slots
_OLD6 = np.tile(np.arange(6), (1, 2))                   # 6 GPUs x 2 slots, 6 experts
_NEW6 = np.roll(_OLD6, 3, axis=1)


# Relabelling and migrate ----------------------------------------------------------------------

@pytest.mark.parametrize("num_nodes", [4, 12, 0, -2, 1.5, True])
def test_relabel_refuses_nodes_that_do_not_split_the_gpus(num_nodes):
    """gpu_assignment fills only nodes x (G // nodes) columns of an uninitialised array: a bad
    node count must stop before it, not turn leftover memory into slot indices."""
    with pytest.raises(EplbError, match="nodes"):
        mg.relabel(_OLD6, _NEW6, 6, 6, num_nodes=num_nodes)
    with pytest.raises(EplbError, match="nodes"):
        mg.migrate(np.ones((1, 6)), _OLD6, _NEW6, Topology(6, 2, num_nodes))


@pytest.mark.parametrize("call, match", [
    (lambda: mg.relabel(_OLD, _NEW, 0, 3), "num_gpus must be"),
    (lambda: mg.relabel(_OLD[0], _NEW[0], 2, 3), r"\[layers, slots\]"),
    (lambda: mg.migrate(_LOAD[0], _OLD, _NEW, _TOPO), "load must be"),
    (lambda: mg.migrate(_LOAD[:1], _OLD, _NEW, _TOPO), "load must be"),
    (lambda: mg.migrate(np.full((2, 3), np.nan), _OLD, _NEW, _TOPO), "finite"),
    (lambda: mg.migrate(_LOAD, _OLD, _NEW, 2), "topology must be an eplb.Topology"),
    (lambda: mg.migrate(_LOAD, _OLD, _NEW, Topology(2, 3)), "holds 6"),
    (lambda: mg.migrate(_LOAD, _OLD, np.array([[1, 0, 2, -1], [2, 1, 0, 0]]), _TOPO), "target_LP"),
])
def test_relabel_and_migrate_name_bad_input(call, match):
    with pytest.raises(EplbError, match=match):
        call()


def test_migrate_keeps_a_permutation_of_the_target():
    """With a node count that splits the GPUs, the relabelled target is a slot permutation."""
    phy, perm, _ = mg.migrate(np.ones((1, 6)), _OLD6, _NEW6, Topology(6, 2, 3))
    assert (np.sort(perm, axis=1) == np.arange(12)).all()
    assert np.array_equal(np.sort(phy, axis=1), np.sort(_NEW6, axis=1))


# Budgeted search ------------------------------------------------------------------------------

def test_budgeted_search_refuses_empty_slots():
    """An empty slot (-1) was priced as expert E - 1 (negative index): the search then emptied
    a replica of expert 0 here, in both versions. restore_missing must fill it first."""
    load = np.array([[0.06002583, 0.97334402]])
    old = np.array([[0, -1, 1, 0]])
    for search in SEARCHES:
        with pytest.raises(EplbError, match="restore_missing"):
            search(load, old, 4, mg.Budget(move_cost=0.001))
    fixed = mg.restore_missing(load, old, 4)
    out = mg.budgeted_search(load, fixed, 4, mg.Budget(move_cost=0.001))
    assert (out >= 0).all() and set(out[0].tolist()) == {0, 1}


@pytest.mark.parametrize("kw, match", [
    (dict(donors=0), "donors"), (dict(donors=-1), "donors"), (dict(partners=0), "partners"),
    (dict(donors=2.5), "donors"), (dict(max_iters=-1), "max_iters"),
    (dict(num_nodes=2, num_expert_groups=0), "num_expert_groups"),
    (dict(num_nodes=2, num_expert_groups=-3), "num_expert_groups"),
    (dict(num_nodes=2, num_expert_groups=1.5), "num_expert_groups"), (dict(num_nodes=0), "num_nodes"),
])
def test_budgeted_search_names_bad_settings(kw, match):
    """donors=0 / partners=0 made the kernel's top-k insertion write index -1 of an empty
    view (into the next scratch array) while the numpy version raised ValueError."""
    for search in SEARCHES:
        with pytest.raises(EplbError, match=match):
            search(_LOAD, _OLD, 2, mg.Budget(move_cost=0.001), **kw)


def test_budgeted_search_accepts_whole_float_settings():
    ref = mg.budgeted_search(_LOAD, _OLD, 2, mg.Budget(move_cost=0.001), num_nodes=2, num_expert_groups=3)
    got = mg.budgeted_search(_LOAD, _OLD, 2, mg.Budget(move_cost=0.001), num_nodes=2.0, num_expert_groups=3.0,
                             donors=8.0)
    np.testing.assert_array_equal(got, ref)
    with pytest.raises(EplbError, match="budget must be a Budget"):
        mg.budgeted_search(_LOAD, _OLD, 2, None)
    with pytest.raises(EplbError, match="old_LP must be"):
        mg.budgeted_search(_LOAD, 5, 2, mg.Budget())


# Counting, restoring, scheduling: edge shapes and bad settings ---------------------------------

@pytest.mark.parametrize("count_moves, scheduler", [(mg.count_moves, mg.schedule),
                                                    (oracle.count_moves, oracle.schedule)], ids=["compiled", "python"])
def test_no_layers_is_a_valid_empty_migration(count_moves, scheduler):
    """L = 0 (a model slice without MoE layers): no moves, no rounds, not an error."""
    assert count_moves(_OLD[:0], _NEW[:0], 2, 3).shape == (0, 2)
    m = scheduler(_OLD[:0], _NEW[:0], 2, 3)
    assert m.num_rounds == 0 and m.num_transfers == 0 and m.moves == 0


@pytest.mark.parametrize("call, match", [
    (lambda: mg.restore_missing(_LOAD, np.array([[0, 1, 5, 0], [0, 1, 2, 2]]), 2), "expert 5"),
    (lambda: mg.restore_missing(_LOAD, _OLD, 3), "do not split evenly over 3 GPUs"),
    (lambda: mg.restore_missing(np.full((2, 3), np.nan), _OLD, 2), "finite"),
    (lambda: mg.restore_missing(_LOAD[:1], _OLD, 2), "load must be"),
    (lambda: mg.restore_missing(_LOAD[0], _OLD, 2), "load must be"),
    (lambda: mg.schedule(_OLD, _NEW, 2, 3, rank_ids=4), "rank_ids"),
    (lambda: mg.schedule(_OLD, _NEW, 2, 3, rank_ids=[0.5, 1]), "rank_ids"),
    (lambda: mg.schedule(_OLD, _NEW, 2, 3, layers_per_chunk="a"), "layers_per_chunk"),
    (lambda: mg.schedule(_OLD, _NEW, 2, 3, layers_per_chunk=1.5), "layers_per_chunk"),
    (lambda: mg.schedule(_OLD, _NEW, 2, 3, layers_per_chunk=0), "layers_per_chunk"),
])
def test_restore_and_schedule_name_bad_input(call, match):
    with pytest.raises(EplbError, match=match):
        call()


def test_huge_layers_per_chunk_is_one_chunk():
    m = mg.schedule(_OLD, _NEW, 2, 3, layers_per_chunk=10**30)
    assert set(m.chunk_R.tolist()) == {0}


# Schedules where the lost experts' slots are the only spare room --------------------------------

def _replay(m, old, new, G):
    from tests.unit.test_migration import replay_and_check

    replay_and_check(m, old, new, G)
    m.check()


def _feasible(old, new, E):
    """Brute force over one-copy steps (a schedule of one-copy rounds is a valid schedule): can
    one layer go from old to new with every expert it holds keeping a replica at every step?"""
    import collections

    start, goal = tuple(old), tuple(new)
    seen, queue = {start}, collections.deque([start])
    while queue:
        cur = queue.popleft()
        if cur == goal:
            return True
        held = collections.Counter(x for x in cur if x >= 0)
        for s, o in enumerate(cur):
            if o >= 0 and held[o] < 2:
                continue                       # the only replica of o
            for e in range(E):
                nxt = cur[:s] + (e,) + cur[s + 1:]
                if e != o and nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
    return False


@pytest.mark.parametrize("scheduler", SCHEDULERS, ids=["compiled", "relay", "python"])
@pytest.mark.parametrize("G, old, new", [
    (3, [0, 1, 1], [1, 2, 0]),                   # 2 lost, 1 doubled: its reload must come last
    (3, [2, 0, -1], [0, 2, 1]),                  # 1 lost: stage the 0 <-> 2 swap through its slot
    (3, [8, 6, 4, 0, 6, 3, 5, 1, 2], [8, 2, 4, 7, 1, 0, 5, 3, 6]),
])
def test_as_many_slots_as_experts_with_lost_experts_is_scheduled(scheduler, G, old, new):
    """P = E after failed ranks: the lost experts' slots are the only spare room. Reloading the
    last one early left every pending slot holding an only replica ('no safe migration')
    although a safe order exists."""
    old, new = np.array([old]), np.array([new])
    assert _feasible(old[0].tolist(), new[0].tolist(), new.shape[1])
    m = scheduler(old, new, G, new.shape[1])
    _replay(m, old, new, G)


def test_schedules_succeed_exactly_when_a_safe_order_exists():
    """Small layers with E >= P - 1, lost experts, duplicates and empty slots: both schedulers
    find a schedule if and only if brute force finds one."""
    seen = set()
    for seed in range(600):
        rng = np.random.default_rng(seed)
        G, S = int(rng.integers(1, 4)), int(rng.integers(1, 3))
        P = G * S
        if P > 5:
            continue
        E = int(rng.integers(max(1, P - 1), P + 1))
        base = np.arange(E)[rng.random(E) > 0.35]
        old = rng.permutation(np.concatenate([base, rng.integers(-1, E, P - base.size)]))[None]
        new = rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, P - E)]))[None]
        feasible = _feasible(old[0].tolist(), new[0].tolist(), E)
        seen.add(feasible)
        for scheduler in SCHEDULERS:
            if feasible:
                _replay(scheduler(old, new, G, E), old, new, G)
            else:
                with pytest.raises(EplbError, match="no safe migration"):
                    scheduler(old, new, G, E)
    assert seen == {True, False}


# Node-locality accounting of the search ---------------------------------------------------------

def _random_case(seed, num_nodes, groups):
    rng = np.random.default_rng(seed)
    G = num_nodes * int(rng.integers(1, 4))
    S = int(rng.integers(2, 5))
    E = groups * int(rng.integers(1, max(2, G * S // groups)))
    E = min(E, G * S - 1) // groups * groups or groups
    from tests.unit.test_migration import random_map

    return rng, G, S, E, random_map(rng, int(rng.integers(1, 4)), G, S, E)


def _node_cases(count=40):
    """(nodes, groups, G, E, old map, load) of the usable seeded cases (2 nodes, 2 or 4 groups)."""
    for seed in range(count):
        num_nodes, groups = (2, 2) if seed % 2 else (2, 4)
        rng, G, S, E, old = _random_case(seed, num_nodes, groups)
        if E % groups or E >= G * S:
            continue
        yield num_nodes, groups, G, E, old, rng.gamma(0.4, 10.0, (old.shape[0], E))


@pytest.mark.parametrize("budget", [mg.Budget(move_cost=0.001, span_cost=0.5), mg.Budget(max_moves=6, span_cost=1.0),
                                    mg.Budget(max_moves_per_gpu=1, span_cost=2.0),
                                    mg.Budget(max_moves=20, max_moves_per_gpu=2, move_cost=0.002, span_cost=1.0)])
def test_search_keeps_its_group_node_counts_and_move_counts_exact(monkeypatch, budget):
    """After the kernel ran: its (group, node) counts, replica counts and moves per GPU equal
    the ones recomputed from the map it returns (the prices of the next change read them)."""
    from eplb.migration import _search_kernel
    from eplb.stats.loads import group_span

    seen = {}
    real = _search_kernel.search

    def spy(*args):
        total = real(*args)
        seen.update(phy=args[1], r_LE=args[2], cnt_LEG=args[3], in_G=args[5], total=total, gn_LKN=args[-1])
        return total

    monkeypatch.setattr(_search_kernel, "search", spy)
    checked = 0
    for num_nodes, groups, G, E, old, load in _node_cases():
        out = mg.budgeted_search(load, old, G, budget, num_nodes=num_nodes, num_expert_groups=groups)
        assert seen["phy"] is out
        L, P = old.shape
        gn = np.zeros((L, groups, num_nodes), dtype=np.int64)
        grp, node = out // (E // groups), (np.arange(P) // (P // G)) // (G // num_nodes)
        np.add.at(gn, (np.arange(L)[:, None], grp, np.broadcast_to(node, out.shape)), 1)
        np.testing.assert_array_equal(seen["gn_LKN"], gn)
        np.testing.assert_array_equal(seen["cnt_LEG"], mg.holdings(out, G, E).transpose(0, 2, 1))
        np.testing.assert_array_equal(seen["r_LE"], seen["cnt_LEG"].sum(axis=2))
        moves_LG = mg.count_moves(old, out, G, E)
        np.testing.assert_array_equal(seen["in_G"], moves_LG.sum(axis=0))
        assert seen["total"] == moves_LG.sum()
        assert (group_span(out, Topology(G, out.shape[1] // G, num_nodes), groups, E) >= 1).all()
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("budget", [mg.Budget(move_cost=0.001, span_cost=0.5), mg.Budget(max_moves=6, span_cost=1.0),
                                    mg.Budget(max_moves=20, max_moves_per_gpu=2, move_cost=0.002, span_cost=1.0)])
def test_search_prices_group_span_as_the_numpy_reference(budget):
    for num_nodes, groups, G, _, old, load in _node_cases(20):
        np.testing.assert_array_equal(
            mg.budgeted_search(load, old, G, budget, num_nodes=num_nodes, num_expert_groups=groups),
            oracle.budgeted_search(load, old, G, budget, num_nodes=num_nodes, num_expert_groups=groups))


def test_prohibitive_span_cost_never_adds_a_group_node_pair():
    from eplb.stats.loads import group_span

    for num_nodes, groups, G, E, old, load in _node_cases():
        # With move_cost 0 the price only ranks changes (any gain passes the threshold): a
        # price refuses a change only through move_cost x (1 + span_cost x pairs added).
        for budget in (mg.Budget(move_cost=0.001, span_cost=1e6),
                       mg.Budget(max_moves=8, move_cost=1e-4, span_cost=1e6)):
            out = mg.budgeted_search(load, old, G, budget, num_nodes=num_nodes, num_expert_groups=groups)
            topo = Topology(G, old.shape[1] // G, num_nodes)
            before = group_span(old, topo, groups, E).sum(axis=1)
            assert (group_span(out, topo, groups, E).sum(axis=1) <= before).all()
            # span_cost 0 is the node-blind search, to the slot.
            blind = mg.Budget(budget.max_moves, budget.max_moves_per_gpu, budget.move_cost, 0.0)
            np.testing.assert_array_equal(
                mg.budgeted_search(load, old, G, blind, num_nodes=num_nodes, num_expert_groups=groups),
                oracle.budgeted_search(load, old, G, blind))


# MigrationPlan: invariants on construction -------------------------------------------------------

def _plan_kw(**kw):
    d = dict(old_LP=_OLD, new_LP=_NEW, slots_per_gpu=2, num_logical_experts=3, round_M=[0], layer_M=[0], expert_M=[1],
             src_rank_M=[0], src_slot_M=[1], dst_rank_M=[0], dst_slot_M=[0], staging_M=[False], chunk_R=[0],
             rank_ids_G=[0, 1])
    d.update(kw)
    return d


@pytest.mark.parametrize("kw, match", [
    (dict(layer_M=[5]), "transfer 0"), (dict(dst_slot_M=[9]), "transfer 0"), (dict(expert_M=[9]), "transfer 0"),
    (dict(src_slot_M=[-3]), "transfer 0"), (dict(dst_rank_M=[1]), "transfer 0"),
    (dict(src_rank_M=[-1]), "transfer 0"),                       # a reload names no source slot
    (dict(slots_per_gpu=3), "rank_ids_G"), (dict(rank_ids_G=[0, 1, 2]), "rank_ids_G"),
    (dict(old_LP=_OLD + 5), "expert"), (dict(num_logical_experts=0), "num_logical_experts"),
    (dict(round_M=[0.5]), "whole numbers"), (dict(layer_M=[[0]]), "1-D"),
])
def test_migration_plan_checks_its_indices(kw, match):
    """serving / state_before / check index the maps by these values (an engine too): a plan
    with one out of range used to be built, then failed with IndexError or served wrong slots."""
    mg.MigrationPlan(**_plan_kw())                                # the valid one
    with pytest.raises(EplbError, match=match):
        mg.MigrationPlan(**_plan_kw(**kw))


def test_migration_plan_rounds_must_be_whole():
    m = mg.schedule(_OLD, _NEW, 2, 3)
    for k in (1.5, "1", True, None):
        with pytest.raises(EplbError, match="round"):
            m.serving(k)
        with pytest.raises(EplbError, match="round"):
            m.state_before(k)
    assert np.array_equal(m.state_before(np.int64(m.num_rounds)), _NEW)


def test_schedulers_agree_on_random_failed_rank_style_maps():
    """Old maps with empty slots, lost and doubled experts, E up to P, 1..4 layers, every chunk
    size: the compiled and the Python scheduler both pass the replay, or both refuse."""
    outcomes = set()
    for seed in range(400):
        rng = np.random.default_rng(seed)
        G, S, L = int(rng.integers(1, 7)), int(rng.integers(1, 4)), int(rng.integers(1, 5))
        P = G * S
        E = int(rng.integers(1, P + 1))
        chunk = int(rng.integers(1, L + 2))
        rows = []
        for _ in range(L):
            base = np.arange(E)[rng.random(E) > 0.3 * (seed % 2)]
            rows.append(rng.permutation(np.concatenate([base, rng.integers(-(seed % 3 > 0), E, P - base.size)])))
        old = np.stack(rows)
        new = np.stack([rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, P - E)])) for _ in range(L)])
        got = []
        for scheduler in SCHEDULERS:
            try:
                m = scheduler(old, new, G, E, layers_per_chunk=chunk)
            except EplbError as exc:
                assert "no safe migration" in str(exc)
                got.append(False)
                continue
            _replay(m, old, new, G)
            assert (np.diff(m.layer_M // chunk) >= 0).all()
            got.append(True)
        assert got[0] == got[1], f"seed {seed}: compiled {got[0]}, python {got[1]}"
        outcomes.add(got[0])
    assert outcomes == {True, False}


@pytest.mark.parametrize("bad", ["a", True, 0, 2.5])
def test_bytes_per_expert_must_be_a_positive_count(bad):
    """'a' gave a ValueError traceback; True and 0 were taken (bytes 1 x or 0 x the copies)."""
    from eplb import plan

    rng = np.random.default_rng(0)
    prev = plan(rng.random((2, 8)), num_gpus=2).placement
    with pytest.raises(EplbError, match="bytes_per_expert"):
        plan(rng.random((2, 8)), num_gpus=2, previous=prev, budget=mg.Budget(bytes_per_expert=bad))
    with pytest.raises(EplbError, match="bytes_per_expert"):
        mg.schedule(_OLD, _NEW, 2, 3, bytes_per_expert=bad)


@pytest.mark.parametrize("kw, match", [
    # Slot 3 written twice in one round (two local copies, no link limit involved).
    (dict(old_LP=[[0, 1, 2, 0]], new_LP=[[0, 1, 2, 1]], slots_per_gpu=4, rank_ids_G=[0], round_M=[0, 0],
          layer_M=[0, 0], expert_M=[0, 1], src_rank_M=[0, 0], src_slot_M=[0, 1], dst_rank_M=[0, 0],
          dst_slot_M=[3, 3], staging_M=[False, False]), "written twice"),
    # The only replica of expert 1 is overwritten while nothing else serves it.
    (dict(old_LP=[[0, 1, 2, 0]], new_LP=[[0, 0, 2, 0]], slots_per_gpu=4, rank_ids_G=[0]), "no serving replica"),
    # A slot that is read and written in the same round.
    (dict(old_LP=[[0, 1, 2, 1]], new_LP=[[1, 0, 2, 1]], slots_per_gpu=4, rank_ids_G=[0], round_M=[0, 0],
          layer_M=[0, 0], expert_M=[1, 0], src_rank_M=[0, 0], src_slot_M=[1, 0], dst_rank_M=[0, 0],
          dst_slot_M=[0, 1], staging_M=[False, False]), "both a source and written"),
    # No transfers, but new_LP differs from old_LP.
    (dict(round_M=[], layer_M=[], expert_M=[], src_rank_M=[], src_slot_M=[], dst_rank_M=[], dst_slot_M=[],
          staging_M=[], chunk_R=[]), "ends with expert"),
])
def test_migration_plan_check_replays_every_guarantee(kw, match):
    """check() is the one replay of a plan (the runtime runs it before moving weights)."""
    base = dict(round_M=[0], layer_M=[0], expert_M=[0], src_rank_M=[0], src_slot_M=[0], dst_rank_M=[0],
                dst_slot_M=[1], staging_M=[False])
    m = mg.MigrationPlan(**_plan_kw(**{**base, **kw}))
    with pytest.raises(EplbError, match=match):
        m.check()
    mg.schedule(_OLD, _NEW, 2, 3).check()                          # a scheduled plan passes
