"""The robust planners' packing and swap search make the swaps of their plain references
(tests/oracles/robust.py), to the bit, on seeded cases."""

import numpy as np
import pytest

from eplb.core.topology import Topology
from eplb.stats.loads import replica_counts_minmax
from planners.api import PlanRequest
from planners.robust import (
    RobustPlanner,
    normalise_windows,
    one_window_orders,
    pack_vector,
    robust_demand,
    smooth_max_swaps,
)
from tests.oracles import robust as oracle


def _packed(seed, T, L, E, G, S, blend=1.0):
    rng = np.random.default_rng(seed)
    h = np.floor(rng.pareto(1.2, (T, L, E)) * 100) + 1
    share = normalise_windows(h, G)
    count = replica_counts_minmax(robust_demand(share, blend), G * S, max_replicas=G)
    return share, count


def _slot_loads(share, count, phy):
    return np.take_along_axis(np.moveaxis(share / count[None], 0, 2), phy[:, :, None], axis=1)


# (seed, windows, layers, experts, GPUs, slots per GPU): many windows, one window (every
# pairing of a round costs the same then, so rounds pair in a seeded order; with 8 or more
# slots numpy sums a GPU's slots pairwise), one slot.
CASES = [(0, 6, 4, 32, 4, 9), (1, 6, 4, 32, 8, 5), (2, 1, 4, 32, 8, 5), (3, 1, 3, 64, 32, 3), (4, 5, 3, 32, 32, 1),
         (5, 1, 4, 64, 8, 9), (6, 12, 3, 32, 4, 9)]


def _is_valid(phy, count, G, S):
    """Every GPU holds S distinct experts, and each expert its replica count."""
    L = phy.shape[0]
    for l in range(L):
        assert all(len(set(phy[l, g * S:(g + 1) * S].tolist())) == S for g in range(G))
        np.testing.assert_array_equal(np.bincount(phy[l], minlength=count.shape[1]), count[l])


@pytest.mark.parametrize("seed,T,L,E,G,S", CASES)
def test_packing_is_valid_and_one_window_rounds_pair_in_the_seeded_order(seed, T, L, E, G, S):
    share, count = _packed(seed, T, L, E, G, S)
    phy = pack_vector(share, count, Topology(G, S))
    _is_valid(phy, count, G, S)
    # The packing order (heaviest replica first, in its worst window, then in total).
    w_TLE = share / count[None]
    order_LE = np.argsort(-(w_TLE.max(axis=0) + 1e-12 * w_TLE.sum(axis=0)), axis=1, kind="stable")
    rep_LP = np.repeat(order_LE.ravel(), np.take_along_axis(count, order_LE, 1).ravel()).reshape(L, G * S)
    if T == 1:  # each round in the seeded GPU order
        np.testing.assert_array_equal(phy, oracle.pack_one_window(rep_LP, one_window_orders(L, S, G), G, S))
    else:       # each round the assignment of its layer's own costs
        np.testing.assert_array_equal(phy, oracle.pack_windows(share, count, rep_LP, G, S))


@pytest.mark.parametrize("seed,T,L,E,G,S", CASES)
@pytest.mark.parametrize("quantile,units", [(1.0, 1), (0.7, 1), (1.0, 2)])
def test_swaps_are_the_reference_swaps(seed, T, L, E, G, S, quantile, units):
    share, count = _packed(seed, T, L, E, G, S)
    phy = pack_vector(share, count, Topology(G, S))
    w_LPT = _slot_loads(share, count, phy)
    bound = np.random.default_rng(seed).random(phy.shape) < 0.3 if units > 1 else None
    runs = []
    for search in (oracle.smooth_max_swaps, smooth_max_swaps):
        p, w, b = phy.copy(), w_LPT.copy(), None if bound is None else bound.copy()
        search(p, w, G, beta=50.0, max_rounds=100, quantile=quantile, num_units=units, bound_LP=b)
        runs.append((p, w, b))
    (p0, w0, b0), (p1, w1, b1) = runs
    assert not np.array_equal(p0, phy) or S == 1  # the search did swap
    np.testing.assert_array_equal(p1, p0)
    np.testing.assert_array_equal(w1, w0)  # slot loads travel with their replicas
    if bound is not None:
        np.testing.assert_array_equal(b1, b0)
        # A bound slot stays in its unit of G / units consecutive GPUs.
        unit_P = np.arange(G * S) // S // (G // units)
        for l in range(L):
            for e in np.unique(phy[l][bound[l]]):
                assert sorted(unit_P[(phy[l] == e) & bound[l]]) == sorted(unit_P[(p1[l] == e) & b1[l]])
    _is_valid(p1, count, G, S)


@pytest.mark.parametrize("units", [1, 2])
def test_swaps_scored_a_few_layers_at_a_time_are_the_reference_swaps(monkeypatch, units):
    """Gains scored in chunks of 1, 2 or 3 layers (the last chunk short) give the same swaps."""
    import planners.robust as robust

    share, count = _packed(11, 5, 7, 32, 8, 5)
    phy = pack_vector(share, count, Topology(8, 5))
    w_LPT = _slot_loads(share, count, phy)
    bound = np.random.default_rng(11).random(phy.shape) < 0.3 if units > 1 else None
    p0, w0 = phy.copy(), w_LPT.copy()
    oracle.smooth_max_swaps(p0, w0, 8, beta=50.0, max_rounds=100, num_units=units,
                            bound_LP=None if bound is None else bound.copy())
    for layers in (1, 2, 3):
        monkeypatch.setattr(robust, "_CHUNK", layers * 2 * 5 * 40)         # Q x P = 2 x 5 x 40 a layer
        p1, w1 = phy.copy(), w_LPT.copy()
        smooth_max_swaps(p1, w1, 8, beta=50.0, max_rounds=100, num_units=units,
                         bound_LP=None if bound is None else bound.copy())
        np.testing.assert_array_equal(p1, p0)
        np.testing.assert_array_equal(w1, w0)


def test_search_works_in_place_on_other_dtypes_and_orders():
    share, count = _packed(0, 4, 3, 32, 4, 9)
    phy = pack_vector(share, count, Topology(4, 9))
    w_LPT = _slot_loads(share, count, phy)
    p0, w0 = phy.copy(), w_LPT.copy()
    smooth_max_swaps(p0, w0, 4, beta=50.0, max_rounds=50)
    p1, w1 = phy.astype(np.int32), np.asfortranarray(w_LPT)
    smooth_max_swaps(p1, w1, 4, beta=50.0, max_rounds=50)
    assert not np.array_equal(p0, phy)
    np.testing.assert_array_equal(p0, p1)
    np.testing.assert_array_equal(w0, w1)


def test_one_window_packing_with_an_expert_on_every_gpu():
    # One expert takes a replica on each of the 8 GPUs, straddling rounds: the seeded in-order
    # pairing must still keep replicas of one expert on distinct GPUs.
    share = normalise_windows(np.array([[[400.0] + [1.0 + i for i in range(23)]]]), 8)
    count = replica_counts_minmax(robust_demand(share, 0.0), 8 * 4, max_replicas=8)
    assert count[0, 0] == 8
    _is_valid(pack_vector(share, count, Topology(8, 4)), count, 8, 4)


def test_searches_cut_short_end_where_the_reference_does():
    # 16 GPUs and top_gpus = 2: many rounds keep the peak; a search cut short after any number
    # of rounds has made the reference's swaps.
    share, count = _packed(9, 8, 3, 64, 16, 5)
    phy = pack_vector(share, count, Topology(16, 5))
    w_LPT = _slot_loads(share, count, phy)
    for rounds in (1, 3, 10, 100):
        p0, w0, p1, w1 = phy.copy(), w_LPT.copy(), phy.copy(), w_LPT.copy()
        oracle.smooth_max_swaps(p0, w0, 16, beta=50.0, max_rounds=rounds)
        smooth_max_swaps(p1, w1, 16, beta=50.0, max_rounds=rounds)
        np.testing.assert_array_equal(p1, p0)


@pytest.mark.parametrize("T", [1, 4])
def test_a_plan_is_the_same_every_run(T):
    share, _ = _packed(10, T, 3, 32, 4, 9)
    request = PlanRequest(share.sum(axis=0), Topology(4, 9), history_TLE=share)
    first, again = RobustPlanner().plan(request), RobustPlanner().plan(request)
    np.testing.assert_array_equal(first.phy2log_LP, again.phy2log_LP)
    assert first.message == f"balanced against {T} window(s)" and "compiled" not in first.info
