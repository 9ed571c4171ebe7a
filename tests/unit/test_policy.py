"""Online policies (eplb.serving.policy): load estimate, change detector, repair, decisions."""

import numpy as np
import pytest

from eplb import EplbError, plan
from eplb.serving.policy import (
    AdaptivePolicy,
    BucketedSum,
    ChangeDetector,
    StaticPolicy,
    WindowMemory,
    WindowPolicy,
    get_policy,
    normalise,
    robust_repair,
    window_imbalance,
)

L, E, G, S = 3, 16, 4, 5


def windows(rng, T, hot=(0,), boost=6.0, tokens=4000):
    """T windows of multinomial counts [T, L, E] with the given hot experts."""
    p = rng.gamma(3.0, 1.0, (L, E))
    p[:, list(hot)] *= boost
    p /= p.sum(axis=1, keepdims=True)
    return np.stack([np.stack([rng.multinomial(tokens, p[l]) for l in range(L)]) for _ in range(T)]).astype(float)


def test_window_memory_keeps_the_newest_windows_in_order():
    m = WindowMemory(3, 2, 4)
    for t in range(5):
        m.push(np.full((2, 4), float(t)))
    assert len(m) == 3 and m.windows()[:, 0, 0].tolist() == [2.0, 3.0, 4.0]
    assert m.total()[0, 0] == 9.0
    assert m.nbytes == 3 * 2 * 4 * 8


def test_bucketed_sum_is_exact_up_to_the_bucket_count_and_bounded_beyond(rng):
    obs = rng.poisson(5.0, (300, 2, 3)).astype(float)
    exact = BucketedSum(10, 2, 3, buckets=64)
    for t, c in enumerate(obs):
        exact.add(c)
        np.testing.assert_allclose(exact.sum_LE, obs[max(0, t - 9):t + 1].sum(axis=0))
    s = BucketedSum(100, 2, 3, buckets=8)        # 7 buckets of 13 observations
    for t, c in enumerate(obs):
        s.add(c)
        if t >= 100:
            lo = obs[t + 1 - (100 - 2 * s.width + 2):t + 1].sum(axis=0)
            hi = obs[t - 99:t + 1].sum(axis=0)
            assert (s.sum_LE >= lo - 1e-9).all() and (s.sum_LE <= hi + 1e-9).all()


def test_bucketed_sum_memory_does_not_grow_with_the_window():
    # Issue 12: at DeepSeek-V3 shape (58 x 256) a 1,000-observation window stored 113 MB.
    s = BucketedSum(1000, 58, 256)
    assert s.nbytes <= 16 * 2**20
    assert s.nbytes <= BucketedSum(10**6, 58, 256).nbytes <= 16 * 2**20


def test_change_detector_fires_on_a_shift_not_on_noise(rng):
    steady_ML = 1.1 + 0.02 * rng.standard_normal((12, 4))
    assert not ChangeDetector().flags(steady_ML).any()
    shifted = steady_ML.copy()
    shifted[-1, 2] = 1.8
    assert ChangeDetector().flags(shifted).tolist() == [False, False, True, False]
    assert not ChangeDetector(kappa=0).flags(shifted).any()


def test_robust_repair_keeps_a_valid_map_and_never_worsens_the_worst_window(rng):
    hist = windows(rng, 6, hot=(0, 1))
    start = plan(hist[:3], num_gpus=G, slots_per_gpu=S, planner="greedy").placement
    new_hist = windows(rng, 6, hot=(9, 12), boost=10.0)       # other experts turn hot
    share = normalise(new_hist, G)
    out = robust_repair(start.phy2log_LP, share, G, swaps=4)
    for l in range(L):
        assert set(out[l]) == set(range(E))                   # every expert keeps a replica
        for g in range(G):
            gpu = out[l, g * S:(g + 1) * S]
            assert len(set(gpu)) == S                         # never two replicas on one GPU
    before = window_imbalance(start.phy2log_LP, share, G).max(axis=0)
    after = window_imbalance(out, share, G).max(axis=0)
    assert (after <= before + 1e-12).all() and after.mean() < before.mean()


def test_adaptive_policy_answers_a_shift_and_keeps_still_on_steady_traffic(rng):
    hist = windows(rng, 8, hot=(0,))
    start = plan(hist, num_gpus=G, slots_per_gpu=S, planner="robust").placement
    pol = AdaptivePolicy(memory=8)
    for c in hist:
        pol.observe(c, start)
    steady = pol.decide(start)
    assert steady is None or steady.changed_L.sum() <= 1
    hot = 11
    shifted = windows(rng, 2, hot=(0, hot), boost=12.0)
    for c in shifted:
        pol.observe(c, start)
    d = pol.decide(start)
    assert d is not None and d.changed_L.any() and d.flagged_L.any()
    before = start.replica_count_LE[:, hot]
    after = np.array([(d.phy2log_LP[l] == hot).sum() for l in range(L)])
    assert (after >= before).all() and (after > before).any()
    assert (d.phy2log_LP[~d.changed_L] == start.phy2log_LP[~d.changed_L]).all()
    assert pol.memory_bytes == 8 * L * E * 8


def test_window_and_static_policies(rng):
    hist = windows(rng, 4, hot=(0,))
    start = plan(hist, num_gpus=G, slots_per_gpu=S, planner="greedy").placement
    win = WindowPolicy(window=2)
    for c in windows(rng, 3, hot=(5,), boost=12.0):
        win.observe(c, start)
    d = win.decide(start)
    assert d is not None and d.changed_L.any()
    st = StaticPolicy()
    st.observe(hist[0], start)
    assert st.decide(start) is None
    assert WindowPolicy(window="all").window is None


def test_get_policy_checks_names_and_settings():
    assert isinstance(get_policy("adaptive", {"memory": 4}), AdaptivePolicy)
    with pytest.raises(EplbError, match="unknown policy 'nope'"):
        get_policy("nope")
    with pytest.raises(EplbError, match="no setting 'windw'.*window, planner, move_cost"):
        get_policy("window", {"windw": 3})
    with pytest.raises(EplbError, match="memory"):
        get_policy("adaptive", {"memory": 0})
    with pytest.raises(EplbError, match="move_cost"):
        get_policy("adaptive", {"move_cost": -1})
    with pytest.raises(EplbError, match="lacks observe"):
        get_policy(object())


@pytest.mark.parametrize("seed", range(12))
def test_repair_kernel_matches_the_numpy_reference_slot_by_slot(seed):
    """The compiled repair (incremental loads, factored swap gains) against tests/oracles/policy.py
    (loads afresh, gains summed directly), with and without move caps and partner limits."""
    from eplb.serving.policy import repair
    from tests.oracles import policy as oracle

    rng = np.random.default_rng(seed)
    Lr, Er, Gr, Sr, M = 3, 12, 4, 4, 5
    p = rng.gamma(1.0, 1.0, (Lr, Er))
    win = np.stack([rng.poisson(200 * p * rng.gamma(3, 1 / 3, (Lr, Er))) for _ in range(M)]).astype(float)
    start = plan(rng.gamma(1.0, 1.0, (Lr, Er)), num_gpus=Gr, slots_per_gpu=Sr).placement.phy2log_LP
    kw = dict(rounds_L=rng.integers(0, 6, Lr), partners=(8, 2)[seed % 2])
    if seed % 3 == 0:
        kw.update(max_moves=float(rng.integers(1, 6)), max_moves_G=rng.integers(1, 3, Gr).astype(float))
    elif seed % 4 == 1:
        kw.update(max_moves_G=rng.integers(0, 3, Gr).astype(float))
    new, cost = repair(start, win, Gr, **kw)
    ref_new, ref_cost = oracle.repair(start, win, Gr, **kw)
    np.testing.assert_array_equal(new, ref_new)
    np.testing.assert_allclose(cost, ref_cost, rtol=0, atol=1e-12)
    if "max_moves_G" in kw:
        from eplb.migration import count_moves

        m_LG = count_moves(start, new, Gr, Er)
        assert (m_LG.sum(axis=1) <= kw.get("max_moves", np.inf)).all() and (m_LG <= kw["max_moves_G"]).all()
