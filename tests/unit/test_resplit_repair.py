"""Placements for the re-split rule (eplb.serving.resplit_repair): exact scores and the local search."""

import numpy as np
import pytest

from eplb import EplbError
from eplb.core.placement import Placement
from eplb.dispatch.rules import Resplitter, optimal_weights
from eplb.migration import Budget
from eplb.serving.policy import AdaptivePolicy
from eplb.serving.resplit_repair import resplit_decision, resplit_imbalance, resplit_repair, scenarios
from eplb.stats.loads import imbalance

L, E, G, S = 3, 10, 4, 3


def random_placement(rng):
    """[L, P]: every expert once, the spare slots random experts, shuffled over the GPUs."""
    rows = [rng.permutation(np.r_[np.arange(E), rng.integers(0, E, G * S - E)]) for _ in range(L)]
    return np.stack(rows)


def windows(rng, M=5):
    p = rng.gamma(1.0, 1.0, (L, E))
    return np.stack([np.stack([rng.multinomial(2000, p[l] / p[l].sum()) for l in range(L)])
                     for _ in range(M)]).astype(np.float64)


@pytest.mark.parametrize("seed", range(4))
def test_exact_scores_are_the_best_split(seed):
    """Hall's bound over all GPU sets equals the LP's busiest GPU, and the runtime rule reaches it."""
    rng = np.random.default_rng(seed)
    phy, win = random_placement(rng), windows(rng)
    pl = Placement(phy, G, E)
    got_ML = resplit_imbalance(phy, win, G)
    for m in range(len(win)):
        lp = imbalance(pl.gpu_loads(win[m], optimal_weights(pl, win[m])))
        np.testing.assert_allclose(got_ML[m], lp, rtol=1e-9)
        rs = imbalance(pl.gpu_loads(win[m], Resplitter(pl)(win[m], sweeps=64)))
        assert (rs >= got_ML[m] - 1e-9).all()


@pytest.mark.parametrize("seed", range(4))
def test_the_search_lowers_its_cost_and_keeps_a_valid_placement(seed):
    rng = np.random.default_rng(seed)
    phy, win = random_placement(rng), windows(rng)
    new, cost_L2 = resplit_repair(phy, win, G, rounds=8)
    assert new.shape == phy.shape
    assert all(set(range(E)) <= set(row) for row in new)          # every expert keeps a replica
    assert (cost_L2[:, 1] <= cost_L2[:, 0] + 1e-12).all()
    # The reported costs are half the mean, half the worst of the exact scores on the scenarios.
    load, w_M = scenarios(win, G)
    for row, col in ((phy, 0), (new, 1)):
        busiest_ML = resplit_imbalance(row, load, G)
        want = 0.5 * np.average(busiest_ML, axis=0, weights=w_M) + 0.5 * busiest_ML.max(axis=0)
        np.testing.assert_allclose(cost_L2[:, col], want, rtol=1e-9)


def test_a_high_move_price_changes_nothing_and_a_balanced_layer_stays():
    rng = np.random.default_rng(5)
    phy, win = random_placement(rng), windows(rng)
    new, _ = resplit_repair(phy, win, G, price=10.0)
    np.testing.assert_array_equal(new, phy)
    one = np.full((1, L, E), 10.0)                        # 100 tokens a layer: 25 a GPU is reachable
    first, cost_L2 = resplit_repair(phy, one, G, rounds=50, spread=(1.0,))
    done = np.isclose(cost_L2[:, 1], 1.0)
    assert done.all()
    again, cost2_L2 = resplit_repair(first, one, G, rounds=50, spread=(1.0,))
    np.testing.assert_array_equal(again[done], first[done])


def test_the_decision_keeps_only_layers_that_pay():
    rng = np.random.default_rng(6)
    phy, win = random_placement(rng), windows(rng)
    free, pays_L, gain_L = resplit_decision(phy, win, np.ones(len(win)), G, E, 0.0, (1.0, 1.5), 8)
    assert pays_L.any() and (gain_L[pays_L] > 0).all()
    np.testing.assert_array_equal(free[~pays_L], phy[~pays_L])
    _, pays_high, _ = resplit_decision(phy, win, np.ones(len(win)), G, E, 1.0, (1.0, 1.5), 8)
    assert not pays_high.any()


def test_bad_settings_and_inputs_name_the_value():
    with pytest.raises(EplbError, match="'fast'"):
        AdaptivePolicy(rule="fast")
    with pytest.raises(EplbError, match="one horizon"):
        AdaptivePolicy(rule="resplit", horizons="2,4")
    with pytest.raises(EplbError, match="16"):
        resplit_imbalance(np.zeros((1, 32), dtype=np.int64), np.ones((1, 1, 2)), 16)
    rng = np.random.default_rng(7)
    phy, win = random_placement(rng), windows(rng)
    pol = AdaptivePolicy(rule="resplit")
    pl = Placement(phy, G, E)
    for w in win:
        pol.observe(w, pl)
    with pytest.raises(EplbError, match="max_moves"):
        pol.decide(pl, Budget(max_moves=3))
    d = pol.decide(pl, Budget(move_cost=0.0))
    assert d is None or d.phy2log_LP.shape == phy.shape


def test_real_calls_reach_the_kernels_with_one_argument_type_list():
    """A read-only Placement map, a policy's windows and float32 windows reach the kernels as one
    type list each (eplb.core.jit: one cache entry each)."""
    from eplb.serving import _resplit_kernel as k

    rng = np.random.default_rng(8)
    pl = Placement(random_placement(rng), G, E)
    pol = AdaptivePolicy(rule="resplit", resplit_move_cost=0.0)
    for w in windows(rng, M=4).astype(np.int64):
        pol.observe(w, pl)
    pol.decide(pl)
    resplit_imbalance(pl.phy2log_LP, windows(rng).astype(np.float32), G)
    resplit_imbalance(pl.phy2log_LP, windows(rng), G)
    assert [len(f._state) for f in (k.resplit_search, k.resplit_busiest)] == [1, 1]
