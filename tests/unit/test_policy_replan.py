"""The adaptive policy's replan path: a workload switch that a few swaps cannot follow gets a
fresh plan, renamed onto the placement in force (eplb.serving.policy.renamed)."""

import numpy as np
import pytest

from eplb import EplbError, plan, stats
from eplb.core.placement import Placement
from eplb.migration import count_moves, relabel
from eplb.migration.moves import fewest_moves
from eplb.serving.policy import AdaptivePolicy, get_policy, renamed
from tests.placements import skewed_counts

L, E, G, S = 2, 64, 64, 2


def workload(seed):
    return skewed_counts(seed, L, E)


def greedy_maps(seed_old, seed_new):
    """Greedy maps [L, G x S] of two workloads: the one served and a fresh plan to rename."""
    return tuple(plan(workload(k), num_gpus=G, slots_per_gpu=S).placement.phy2log_LP for k in (seed_old, seed_new))


def balance(placement, load_LE):
    return float(np.median(stats.imbalance(placement.gpu_loads(load_LE))))


def test_a_switch_gets_a_fresh_plan_within_one_percent_and_repair_alone_does_not():
    a, b = workload(1), workload(2)
    start = plan(a, num_gpus=G, slots_per_gpu=S).placement
    fresh = balance(plan(b, num_gpus=G, slots_per_gpu=S).placement, b)
    got = {}
    for gap in (0.0, 0.05):
        pol = AdaptivePolicy(replan_gap=gap)
        pol.observe(b, start)
        d = pol.decide(start)
        assert d is not None
        got[gap] = balance(Placement(d.phy2log_LP, G, E), b) / fresh
    assert got[0.05] <= 1.01 < 1.05 < got[0.0]


def test_replan_leaves_steady_traffic_alone():
    rng = np.random.default_rng(3)
    p = workload(4) / 400_000
    hist = np.stack([np.stack([rng.multinomial(50_000, q) for q in p]) for _ in range(6)]).astype(float)
    start = plan(hist, num_gpus=G, slots_per_gpu=S, planner="robust").placement
    on, off = AdaptivePolicy(), AdaptivePolicy(replan_gap=0.0)
    for c in hist:
        on.observe(c, start)
        off.observe(c, start)
    d_on, d_off = on.decide(start), off.decide(start)
    same = (d_on is None and d_off is None) or (d_on.phy2log_LP == d_off.phy2log_LP).all()
    assert same


@pytest.mark.parametrize("seed", range(4))
def test_renamed_only_renames_gpus_and_keeps_replicas_in_their_slots(seed):
    rng = np.random.default_rng(seed)
    old, new = greedy_maps(10 + seed, 20 + seed)
    out = renamed(old, new, G, E)
    # The same GPUs' contents, in another order of GPUs.
    per_gpu = lambda x: sorted(map(tuple, np.sort(x.reshape(L, G, S), axis=2)[0]))  # noqa: E731
    assert per_gpu(out) == per_gpu(new)
    # An expert that stays on a GPU stays in its old slot there.
    for l in range(L):
        for p in range(G * S):
            g = p // S
            if old[l, p] in out[l, g * S:(g + 1) * S]:
                assert out[l, p] == old[l, p]
    # Near the optimal renaming, never worse than none.
    m = count_moves(old, out, G, E).sum()
    opt = count_moves(old, np.take_along_axis(new, relabel(old, new, G, E), axis=1), G, E).sum()
    assert opt <= m <= min(count_moves(old, new, G, E).sum(), 1.15 * opt)
    # GPUs permuted as wholes: nothing moves.
    perm_G = rng.permutation(G)
    shuffled = old.reshape(L, G, S)[:, perm_G].reshape(L, G * S)
    assert count_moves(old, renamed(old, shuffled, G, E), G, E).sum() == 0


@pytest.mark.parametrize("seed", range(4))
def test_fewest_moves_bounds_every_renamings_moves(seed):
    rng = np.random.default_rng(seed)
    old, new = greedy_maps(30 + seed, 40 + seed)
    bound_L = fewest_moves(old, new, G, E)
    P = G * S
    # The greedy renaming, the optimal one and random GPU orders all move at least the bound.
    for rows in (renamed(old, new, G, E), np.take_along_axis(new, relabel(old, new, G, E), axis=1),
                 new.reshape(L, G, S)[:, rng.permutation(G)].reshape(L, P)):
        assert (count_moves(old, rows, G, E).sum(axis=1) >= bound_L).all()
    # Reached where the new plan is the old one with its GPUs shuffled: nothing moves.
    shuffled = old.reshape(L, G, S)[:, rng.permutation(G)].reshape(L, P)
    assert (fewest_moves(old, shuffled, G, E) == 0).all()


def test_fewest_moves_counts_each_expert_of_a_gpu_once():
    # Maps with two replicas of an expert on one GPU (old and new): every GPU order moves at
    # least the bound, and swapping two GPUs' contents back is reached exactly.
    rng = np.random.default_rng(7)
    g, s, e = 4, 3, 5
    for _ in range(50):
        old = rng.integers(0, e, (3, g * s))
        new = rng.integers(0, e, (3, g * s))
        bound_L = fewest_moves(old, new, g, e)
        for _ in range(6):
            rows = new.reshape(3, g, s)[:, rng.permutation(g)].reshape(3, g * s)
            assert (count_moves(old, rows, g, e).sum(axis=1) >= bound_L).all()
    old = np.array([[0, 0, 1, 2, 3, 4]])
    assert fewest_moves(old, old[:, [3, 4, 5, 0, 1, 2]], 2, 5).tolist() == [0]


def test_replan_gap_is_checked():
    with pytest.raises(EplbError, match="replan_gap"):
        get_policy("adaptive", {"replan_gap": -0.1})
    assert get_policy("adaptive", {"replan_gap": 0}).replan_gap == 0.0
