"""The adaptive policy's horizon: the newest windows weighed again, and the chooser among several."""

import numpy as np
import pytest

from eplb import EplbError, plan
from eplb.serving.policy import AdaptivePolicy, HorizonChooser, get_policy

L, E, G, S = 3, 16, 4, 5


def draws(rng, p_LE, T, tokens=4000):
    """T windows of multinomial counts [T, L, E] from the shares p_LE."""
    return np.stack([np.stack([rng.multinomial(tokens, p) for p in p_LE]) for _ in range(T)]).astype(float)


def shares(rng, hot, boost):
    p = rng.gamma(3.0, 1.0, (L, E))
    p[:, list(hot)] *= boost
    return p / p.sum(axis=1, keepdims=True)


def test_chooser_keeps_its_horizon_until_another_is_clearly_better():
    ch = HorizonChooser((2, 8), samples=2, margin=0.1, per_layer=False, num_layers=2)
    assert list(ch.choose()) == [8, 8]                       # nothing scored: the longest
    ch.record(np.array([[0.95, 0.95], [1.0, 1.0]]))          # 5% better: within the margin
    assert list(ch.choose()) == [8, 8]
    ch.record(np.array([[0.5, 0.5], [1.0, 1.0]]))            # half mean, half worst: 0.8625 vs 1.0
    assert list(ch.choose()) == [2, 2]
    ch.record(np.array([[1.0, 1.0], [0.95, 0.95]]))          # ring of 2: 0.875 vs 0.9875
    assert list(ch.choose()) == [2, 2]


def test_chooser_per_layer_chooses_each_layer_alone():
    ch = HorizonChooser((1, 4, 16), samples=4, margin=0.0, per_layer=True, num_layers=3)
    ch.record(np.array([[0.1, 2.0, 1.0], [1.0, 1.0, 1.0], [2.0, 0.1, 1.0]]))
    assert list(ch.choose()) == [1, 16, 16]                  # a tie keeps the horizon in use
    whole = HorizonChooser((1, 4, 16), samples=4, margin=0.0, per_layer=False, num_layers=3)
    whole.record(np.array([[0.1, 2.0, 1.0], [1.0, 1.0, 1.0], [2.0, 0.1, 1.0]]))
    assert list(whole.choose()) == [4, 4, 4]                 # summed over layers: 3.1, 3.0, 3.1


@pytest.mark.parametrize("seed", range(3))
def test_the_newest_windows_count_again_beside_every_kept_one(seed):
    """memory 8, horizon 2: the decision is the one made on the 8 windows and the newest 2 three
    more times (round(6 / 2)), here kept as 14 windows of a memory planned on alike (the
    change detector, replan and drift test off: they read the memory itself)."""
    rng = np.random.default_rng(seed)
    hist = np.concatenate([draws(rng, shares(rng, (0,), 6.0), 6), draws(rng, shares(rng, (0, 9), 4.0), 2)])
    start = plan(hist[:4], num_gpus=G, slots_per_gpu=S, planner="robust").placement
    recent = AdaptivePolicy(memory=8, detect=0, replan_gap=0, drift_horizons="off")
    alike = AdaptivePolicy(memory=14, horizons=14, detect=0, replan_gap=0, drift_horizons="off")
    for c in hist:
        recent.observe(c, start)
    for c in np.concatenate([hist] + [hist[-2:]] * 3):
        alike.observe(c, start)
    d, ref = recent.decide(start), alike.decide(start)
    assert ref is not None and d is not None
    assert (d.phy2log_LP == ref.phy2log_LP).all() and np.allclose(d.gain_L, ref.gain_L, rtol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_a_window_weighed_k_times_is_the_window_counted_k_times(seed):
    """The repair's window weights (means and smooth maximum) against the same windows repeated."""
    from eplb.serving.policy import repair

    rng = np.random.default_rng(seed)
    win = np.concatenate([draws(rng, shares(rng, (0,), 6.0), 4), draws(rng, shares(rng, (3, 9), 4.0), 2)])
    start = plan(win[:4], num_gpus=G, slots_per_gpu=S, planner="greedy").placement.phy2log_LP
    w_M = np.array([1.0, 1.0, 1.0, 1.0, 3.0, 3.0])
    rounds_L = np.full(L, 8)
    got, cost = repair(start, win, G, rounds_L=rounds_L, weights_M=w_M)
    ref, ref_cost = repair(start, np.concatenate([win] + [win[4:]] * 2), G, rounds_L=rounds_L)
    assert (got == ref).all() and np.allclose(cost, ref_cost, rtol=1e-12)


def test_chooser_follows_the_trace_short_on_regimes_long_on_noise(rng):
    """Decisions on one window serve a trace whose hot expert changes every few windows best, and
    on the whole memory a trace of noise around one mean (moves free, so only the serving counts)."""
    regimes = [shares(rng, (h,), 10.0) for h in (1, 6, 11, 14)]
    start = plan(draws(rng, regimes[0], 4), num_gpus=G, slots_per_gpu=S, planner="greedy").placement

    def run(windows):
        pol = AdaptivePolicy(memory=8, horizons="1,8", recent_weight=False, horizon_moves=0.0, detect=0,
                             move_cost=0.0)
        cur = start
        for c in windows:
            pol.observe(c, cur)
            d = pol.decide(cur)
            if d is not None:
                from eplb.core.placement import Placement
                cur = Placement(d.phy2log_LP, G, E)
        return pol._chooser.choose()

    shifting = np.concatenate([draws(rng, regimes[i % 4], 4, tokens=20000) for i in range(6)])
    steady = draws(rng, regimes[0], 24, tokens=1500)
    assert (run(shifting) == 1).all()
    assert (run(steady) == 8).all()


def test_layers_on_different_horizons_decide_as_each_horizon_alone(rng):
    """Per layer, each layer's row is the one a policy on that layer's horizon alone decides; under
    a move cap the layers share it and the re-repair of a layer uses its own horizon's windows."""
    from eplb.migration import Budget, count_moves

    hist = np.concatenate([draws(rng, shares(rng, (0,), 6.0), 6), draws(rng, shares(rng, (0, 9), 6.0), 2)])
    start = plan(hist[:4], num_gpus=G, slots_per_gpu=S, planner="robust").placement
    kw = dict(memory=8, move_cost=0.0, detect=0, replan_gap=0)
    per = AdaptivePolicy(horizons="1,8", horizon_per_layer=True, **kw)
    alone = {h: AdaptivePolicy(horizons=h, **kw) for h in (1, 8)}
    for c in hist:
        for pol in (per, *alone.values()):
            pol.observe(c, start)
    for _ in range(per._chooser.samples):      # every kept error: layer 0 on 1 window, the rest on 8
        per._chooser.record(np.array([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))
    assert list(per._chooser.choose()) == [1, 8, 8]
    d, d1, d8 = per.decide(start), alone[1].decide(start), alone[8].decide(start)
    assert (d.phy2log_LP[0] == d1.phy2log_LP[0]).all() and (d.phy2log_LP[1:] == d8.phy2log_LP[1:]).all()
    capped = per.decide(start, Budget(max_moves=3))
    assert capped is not None and 0 < count_moves(start.phy2log_LP, capped.phy2log_LP, G, E).sum() <= 3


def test_horizon_settings_are_checked():
    assert AdaptivePolicy().horizons == (2,)
    assert AdaptivePolicy(memory=1).horizons == (1,)         # the default never exceeds the memory
    assert get_policy("adaptive", {"horizons": "16,4, 2"}).horizons == (2, 4, 16)
    with pytest.raises(EplbError, match=r"horizons \[2, 32\] must be 1 to memory \(16\)"):
        get_policy("adaptive", {"horizons": "2,32"})
    with pytest.raises(EplbError, match="whole numbers of windows separated by commas"):
        get_policy("adaptive", {"horizons": "2,x"})
    with pytest.raises(EplbError, match="horizon"):
        get_policy("adaptive", {"horizons": 0})
    with pytest.raises(EplbError, match="horizon_margin"):
        get_policy("adaptive", {"horizon_margin": -0.5})
    with pytest.raises(EplbError, match="recent_weight must be true or false, got 'yes'"):
        get_policy("adaptive", {"recent_weight": "yes"})
    with pytest.raises(EplbError, match="horizon_per_layer must be true or false"):
        get_policy("adaptive", {"horizon_per_layer": "layer"})
    assert get_policy("adaptive", {"recent_weight": False}).recent_weight is False
    with pytest.raises(EplbError, match="horizon_moves"):
        get_policy("adaptive", {"horizon_moves": -1})
