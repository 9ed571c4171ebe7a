"""Statistics: lower bound against brute force, skew and balance metrics, window aggregation.

Legend: T = windows, L = MoE layers, E = logical experts, G = GPUs, P = physical slots.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from eplb import stats
from eplb.core.placement import Placement
from eplb.errors import EplbError


def brute_lower_bound(load_E: np.ndarray, num_gpus: int, slots: int) -> float:
    """max(total / G, min over every r (sum P, r_e >= 1) of max_e load_e / r_e), by enumeration."""
    E = len(load_E)
    best = np.inf
    for r in itertools.product(range(1, slots - E + 2), repeat=E):
        if sum(r) == slots:
            best = min(best, max(load_E[e] / r[e] for e in range(E)))
    return max(load_E.sum() / num_gpus, best)


@pytest.mark.parametrize("seed", range(12))
def test_lower_bound_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    E = int(rng.integers(1, 5))
    G = int(rng.integers(1, 4))
    P = E + int(rng.integers(0, 4))
    load = np.floor(rng.pareto(1.0, (3, E)) * 50)
    lb = stats.lower_bound(load, G, P)
    assert lb == pytest.approx([brute_lower_bound(row, G, P) for row in load])


def test_lower_bound_known_value_and_replica_counts():
    load = np.array([[90.0, 10, 10, 10]])
    # 6 slots: the hot expert gets 3 replicas (30 each); 2 GPUs: total / G = 60 dominates.
    assert stats.replica_counts_minmax(load, 6).tolist() == [[3, 1, 1, 1]]
    assert stats.lower_bound(load, 2, 6).tolist() == [60.0]
    assert stats.lower_bound(load, 6, 6).tolist() == [30.0]
    # The cap (e.g. G) limits the hot expert's replicas.
    assert stats.replica_counts_minmax(load, 6, max_replicas=2).tolist() == [[2, 2, 1, 1]]
    with pytest.raises(EplbError, match="cannot hold 4 logical experts"):
        stats.replica_counts_minmax(load, 3)
    with pytest.raises(EplbError, match="more than 1 replicas"):
        stats.replica_counts_minmax(load, 6, max_replicas=1)


def test_lower_bound_never_beaten_by_evaluate():
    rng = np.random.default_rng(0)
    load = rng.integers(0, 100, (4, 8)).astype(float)
    phy = np.tile(np.arange(12) % 8, (4, 1))
    report = stats.evaluate(Placement(phy, 4, 8), load)
    assert (report.bound_ratio_L >= 1 - 1e-12).all()


def test_gini_known_values():
    assert stats.gini([[1.0, 1, 1, 1]]).tolist() == [0.0]
    assert stats.gini([[0.0, 0, 0, 1]]) == pytest.approx([0.75])  # (n - 1) / n for one hot expert
    assert stats.gini([[1.0, 2, 3, 4]]) == pytest.approx([0.25])
    assert stats.gini([[0.0, 0, 0]]).tolist() == [0.0]  # idle layer


def test_hot_ratio_imbalance_balancedness_known_values():
    assert stats.hot_ratio([[1.0, 2, 3]]).tolist() == [1.5]
    assert stats.hot_ratio([[0.0, 0]]).tolist() == [1.0]
    assert stats.imbalance([[1.0, 3], [2, 2], [0, 0]]).tolist() == [1.5, 1.0, 1.0]
    # vLLM balancedness: sum of mean GPU loads / sum of max GPU loads = (2 + 2) / (3 + 2).
    assert stats.balancedness([[1.0, 3], [2, 2]]) == pytest.approx(0.8)
    assert stats.balancedness([[0.0, 0]]) == 1.0


def test_ema_and_aggregations_known_values():
    c = np.array([1.0, 2, 3])[:, None, None]  # [T=3, L=1, E=1]
    assert stats.ema(c, 0.5)[:, 0, 0].tolist() == [1.0, 1.5, 2.25]
    assert stats.aggregate(c, "ema", alpha=0.5)[0, 0] == 2.25
    assert stats.aggregate(c, "sum")[0, 0] == 6
    assert stats.aggregate(c, "mean")[0, 0] == 2
    assert stats.aggregate(c, "last")[0, 0] == 3
    assert stats.aggregate(c, "window", window=2)[0, 0] == 5
    assert stats.sliding_sum(c, 2)[:, 0, 0].tolist() == [3.0, 5.0]
    assert stats.aggregate(c[0], "sum").shape == (1, 1)  # [L, E] is one window


def test_aggregation_errors_name_the_value():
    c = np.ones((3, 1, 2))
    with pytest.raises(EplbError, match="unknown aggregation 'median'"):
        stats.aggregate(c, "median")
    with pytest.raises(EplbError, match="window >= 1"):
        stats.aggregate(c, "window")
    with pytest.raises(EplbError, match="alpha must be in"):
        stats.ema(c, 1.5)
    with pytest.raises(EplbError, match="1..3"):
        stats.sliding_sum(c, 4)
    with pytest.raises(EplbError, match="shape"):
        stats.aggregate(np.ones(4))
    # A window or alpha the aggregation does not use was silently ignored (eplb plan --window 2).
    with pytest.raises(EplbError, match="only applies to aggregation 'window'"):
        stats.aggregate(c, "sum", window=2)
    with pytest.raises(EplbError, match="only applies to aggregation 'ema'"):
        stats.aggregate(c, "last", alpha=0.5)


def test_evaluate_report_and_summary():
    load = np.array([[6.0, 2, 2, 2]])
    placement = Placement(np.array([[0, 1, 0, 2, 0, 3]]), 3, 4)  # expert 0 split 3 ways
    rep = stats.evaluate(placement, load)
    assert rep.gpu_load_LG.tolist() == [[4.0, 4.0, 4.0]]  # perfect: total / G = 4 is the bound
    assert rep.imbalance_L.tolist() == [1.0] and rep.bound_ratio_L.tolist() == [1.0]
    worse = stats.evaluate(Placement(np.array([[0, 0, 1, 2, 3, 1]]), 3, 4), load)
    assert worse.gpu_load_LG.tolist() == [[6.0, 3.0, 3.0]]  # two replicas of 0 on GPU 0 help nothing
    assert worse.bound_ratio_L.tolist() == [1.5]
    s = worse.summary()
    assert set(s) == {"imbalance", "bound_ratio", "balancedness"}
    assert s["bound_ratio"]["max"] == 1.5 and s["balancedness"] == pytest.approx(4 / 6)


@pytest.mark.parametrize("call, message", [
    (lambda c: stats.aggregate(c, "window", window=2.5), r"window >= 1, got 2.5"),  # summed the newest 2
    (lambda c: stats.aggregate(c, "window", window=True), r"window >= 1, got True"),
    # alpha="0.5" was a UFuncTypeError.
    (lambda c: stats.aggregate(c, "ema", alpha="0.5"), r"alpha must be in \(0, 1\] \(a number\), got '0.5'"),
    (lambda c: stats.aggregate(c, "ema", alpha=True), r"alpha must be in \(0, 1\] \(a number\), got True"),
    (lambda c: stats.sliding_sum(c, 1.5), r"sliding window size must be a whole number in 1..3 .*, got 1.5"),
    (lambda c: stats.lower_bound(c[0], 0, 4), r"gpus must be a whole number >= 1, got 0"),  # was inf
    (lambda c: stats.lower_bound(c[0], 2, 4.5), r"num_slots must be a whole number"),  # was a TypeError
])
def test_argument_types_are_checked(call, message):
    with pytest.raises(EplbError, match=message):
        call(np.ones((3, 1, 2)))


@pytest.mark.parametrize("bad", [-1.0, np.nan, np.inf])
def test_evaluate_refuses_loads_that_are_not_token_counts(bad):
    """A negative or NaN load was scored (balancedness 1.0 for negative GPU loads)."""
    p = Placement(np.array([[0, 1, 2, 3, 0, 1]]), 2, 4)
    with pytest.raises(EplbError, match="finite and non-negative"):
        stats.evaluate(p, [[bad, 2.0, 3.0, 4.0]])


def test_lower_bound_is_exact_for_loads_closer_than_the_tie_break():
    # Two experts 1e-4 apart at 1e6, 3 slots on 3 GPUs: the best placement gives the hotter
    # expert the extra slot and its busiest GPU carries 1e6 (the colder expert alone). The id
    # tie-break bonus (1e-9 of the hottest load, larger than 1e-4) gave the extra slot to the
    # colder expert, and the "bound" came out at 1e6 + 1e-4, above what this placement achieves.
    load = np.array([[1e6, 1e6 + 1e-4]])
    best = Placement(np.array([[0, 1, 1]]), 3, 2)
    assert best.gpu_loads(load).max() == 1e6
    assert stats.lower_bound(load, 3, 3).tolist() == [1e6]
    assert (stats.evaluate(best, load).bound_ratio_L >= 1.0).all()
    # Planners keep the tie-break (it spreads an idle layer's slots over experts).
    assert stats.replica_counts_minmax(np.zeros((1, 3)), 5).tolist() == [[2, 2, 1]]


def test_sliding_sum_keeps_small_windows_after_large_ones():
    c = np.array([1e10, 1e-3, 2e-3, 5.0])[:, None, None]
    assert stats.sliding_sum(c, 1)[:, 0, 0].tolist() == [1e10, 1e-3, 2e-3, 5.0]
    assert stats.sliding_sum(c, 2)[1:, 0, 0] == pytest.approx([3e-3, 5.002], rel=1e-12)
