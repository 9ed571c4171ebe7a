"""Placements for the re-split rule (eplb.planning.resplit_repair, eplb.dispatch.resplit_score):
scores certified against the exact optimum, and the local search."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb import EplbError
from eplb.core.placement import Placement
from eplb.dispatch.resplit_score import TOL, resplit_bounds
from eplb.dispatch.rules import Resplitter, optimal_weights
from eplb.migration import Budget
from eplb.planning.resplit_repair import resplit_imbalance, resplit_repair, scenarios
from eplb.serving.policy import AdaptivePolicy
from eplb.serving.resplit_decision import resplit_decision
from eplb.stats.loads import imbalance
from tests.oracles.resplit import hall_busiest

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
    """The scores equal Hall's bound over all GPU sets (the oracle) and the LP's busiest GPU, and the
    runtime rule reaches them."""
    rng = np.random.default_rng(seed)
    phy, win = random_placement(rng), windows(rng)
    pl = Placement(phy, G, E)
    got_ML = resplit_imbalance(phy, win, G)
    np.testing.assert_allclose(got_ML, hall_busiest(phy, win, G), atol=TOL)
    for m in range(len(win)):
        lp = imbalance(pl.gpu_loads(win[m], optimal_weights(pl, win[m])))
        np.testing.assert_allclose(got_ML[m], lp, atol=TOL)
        rs = imbalance(pl.gpu_loads(win[m], Resplitter(pl)(win[m], sweeps=64)))
        assert (rs >= got_ML[m] - TOL).all()


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.integers(1, 3), st.integers(0, 6), st.integers(0, 2**31 - 1), st.integers(0, 12))
def test_bounds_hold_the_optimum_after_any_sweeps(g, s, extra, seed, sweeps):
    """After any number of sweeps: lower <= Hall's optimum <= upper; the upper bound never rises."""
    rng = np.random.default_rng(seed)
    e = max(1, g * s - extra)
    phy = np.stack([rng.permutation(np.r_[np.arange(e), rng.integers(0, e, g * s - e)]) for _ in range(2)])
    load = rng.gamma(0.5, 1.0, (3, 2, e)) * (rng.random((3, 2, e)) < 0.8)
    exact = hall_busiest(phy, load, g)
    lo, hi = resplit_bounds(phy, load, g, sweeps)
    assert (lo <= exact + 1e-9).all() and (exact <= hi + 1e-9).all()
    assert (resplit_bounds(phy, load, g, sweeps + 1)[1] <= hi + 1e-9).all()


def test_scores_at_32_gpus_match_the_lp():
    """At 32 GPUs, 9 slots each (DeepSeek-V3's 288), where no enumeration reaches: against HiGHS."""
    rng = np.random.default_rng(11)
    Gb, Eb = 32, 256
    p = rng.gamma(0.7, 1.0, (2, Eb))
    hot = np.argsort(-p, axis=1)[:, :32]
    phy = np.stack([rng.permutation(np.r_[np.arange(Eb), hot[l]]) for l in range(2)])
    win = np.stack([np.stack([rng.multinomial(30000, q / q.sum()) for q in p]) for _ in range(2)]).astype(float)
    got = resplit_imbalance(phy, win, Gb)
    pl = Placement(phy, Gb, Eb)
    for m in range(2):
        np.testing.assert_allclose(got[m], imbalance(pl.gpu_loads(win[m], optimal_weights(pl, win[m]))), atol=TOL)


@pytest.mark.parametrize("seed", range(4))
def test_the_search_lowers_its_cost_and_keeps_a_valid_placement(seed):
    rng = np.random.default_rng(seed)
    phy, win = random_placement(rng), windows(rng)
    new, cost_L2 = resplit_repair(phy, win, G, rounds=8)
    assert new.shape == phy.shape
    assert all(set(range(E)) <= set(row) for row in new)          # every expert keeps a replica
    assert (cost_L2[:, 1] <= cost_L2[:, 0] + 1e-12).all()
    # The reported costs are half the mean, half the worst of feasible splits on the scenarios:
    # at or above the exact scores' (and close to them).
    load, w_M = scenarios(win, G)
    for row, col in ((phy, 0), (new, 1)):
        busiest_ML = resplit_imbalance(row, load, G)
        want = 0.5 * np.average(busiest_ML, axis=0, weights=w_M) + 0.5 * busiest_ML.max(axis=0)
        assert (cost_L2[:, col] >= want - 1e-9).all() and (cost_L2[:, col] <= want + 0.01).all()


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
    with pytest.raises(EplbError, match="30 slots do not split over 16 GPUs"):
        resplit_imbalance(np.zeros((1, 30), dtype=np.int64), np.ones((1, 1, 2)), 16)
    with pytest.raises(EplbError, match="outside 0..1"):
        resplit_imbalance(np.full((1, 32), 5), np.ones((1, 1, 2)), 16)
    with pytest.raises(EplbError, match=r"\[windows, layers, experts\]"):
        resplit_imbalance(np.zeros((2, 32), dtype=np.int64), np.ones((1, 1, 2)), 16)
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


def test_a_plan_for_resplit_at_32_gpus_lowers_the_exact_score():
    """DeepSeek-V3's shape in slots (32 GPUs x 9) on a few layers: the search runs past the old
    12-GPU ceiling and lowers the exact re-split score of the windows it planned on."""
    rng = np.random.default_rng(12)
    Gb, Eb, Lb = 32, 256, 2
    p = rng.gamma(0.5, 1.0, (Lb, Eb))
    hot = np.argsort(-p, axis=1)[:, :32]
    phy = np.stack([np.r_[np.arange(Eb), hot[l]] for l in range(Lb)])
    win = np.stack([np.stack([rng.multinomial(20000, q / q.sum()) for q in p]) for _ in range(3)]).astype(float)
    new, cost_L2 = resplit_repair(phy, win, Gb, rounds=2)
    assert (cost_L2[:, 1] < cost_L2[:, 0]).all()
    assert resplit_imbalance(new, win, Gb).mean() < resplit_imbalance(phy, win, Gb).mean()


def test_a_32_gpu_replay_planned_for_resplit():
    """plan_for="resplit" at 32 GPUs x 9 slots (past the old 12-GPU ceiling) on a small synthetic
    trace: it runs, says what it did, and serves re-split no worse than its own static plan."""
    from eplb.core.topology import Topology
    from eplb.evaluate.replay import replay

    rng = np.random.default_rng(13)
    Lb, Eb = 2, 256
    p = rng.gamma(0.6, 1.0, (Lb, Eb))
    counts = np.stack([np.stack([rng.multinomial(8000, q / q.sum()) for q in p]) for _ in range(6)])
    r = replay(counts, topology=Topology(32, 9), warmup=3, references=("static",), plan_for="resplit")
    assert "searched for the re-split rule" in r.notes[1] and r.settings == {"rule": "resplit"}
    served = [resplit_imbalance(r.phy2log_TLP[t], counts[3 + t][None].astype(float), 32) for t in range(3)]
    static = [resplit_imbalance(r.phy2log_TLP[0], counts[3 + t][None].astype(float), 32) for t in range(3)]
    assert np.mean(served) <= np.mean(static) + 0.01
