"""The compiled scores (eplb/stats/_score_kernel.py) give numpy's scores to the bit, compile only the
versions real calls use, and load only in a process that plans again and again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import eplb
from eplb import planning, stats
from eplb.core.placement import Placement, contiguous_placement
from eplb.stats import _score_kernel as kernel

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def loaded():
    kernel.warm_up()
    assert stats.score_kernel() is kernel


def _numpy_path(monkeypatch):
    monkeypatch.setattr(stats, "score_kernel", lambda: None)


def test_sums_add_in_numpys_order():
    rng = np.random.default_rng(0)
    stack = kernel._stack()
    for n in [*range(1, 300), 383, 384, 385, 1000, 1031, 4096]:
        a = rng.random(n) * 10.0 ** rng.uniform(-6, 9, n)  # magnitudes that make the order show
        assert kernel._sum(a, 0, n, stack) == a.sum(), n
        assert kernel._sum(a, 3, n - 3, stack) == a[3:].sum(), n
    assert np.signbit(kernel._sum(np.array([-0.0, -0.0]), 0, 2, stack))  # numpy keeps -0.0 too


def _cases(rng):
    """(placement, load) pairs: greedy plans, the contiguous baseline, random maps; runs of
    slots per GPU below and above 8, GPU and layer counts above 128 (numpy halves those sums)."""
    shapes = [(3, 16, 4, 5), (4, 16, 8, 3), (2, 40, 4, 12), (5, 64, 8, 9), (2, 300, 160, 2), (140, 8, 2, 4),
              (3, 128, 16, 8), (2, 20, 1, 20), (4, 256, 32, 9)]
    for L, E, G, S in shapes:
        loads = [np.floor(rng.pareto(1.1, (L, E)) * 100), rng.gamma(0.5, 1e3, (L, E)), rng.random((L, E))]
        for i, load in enumerate(loads):
            load[0] = 0.0 if i == 0 else load[0]
            res = eplb.plan(load, num_gpus=G, slots_per_gpu=S)
            phy = np.concatenate([np.tile(np.arange(E), (L, 1)), rng.integers(0, E, (L, G * S - E))], axis=1)
            for row in phy:
                rng.shuffle(row)
            yield Placement(res.solution.phy2log_LP, G, E), load
            yield contiguous_placement(E, res.topology, np.arange(L)), load
            yield Placement(phy, G, E), load


def test_even_reports_are_numpys_to_the_bit(monkeypatch):
    rng = np.random.default_rng(1)
    for pl, load in _cases(rng):
        lb = stats.lower_bound(load, pl.num_gpus, pl.num_slots)
        got = stats.even_report(pl, load, lb)
        with monkeypatch.context() as m:
            _numpy_path(m)
            want = stats.even_report(pl, load, lb)
        generic = stats.evaluate(pl, load, pl.replica_weights(), lower_bound_L=lb)
        for ref in (want, generic):
            np.testing.assert_array_equal(got.gpu_load_LG, ref.gpu_load_LG)
            np.testing.assert_array_equal(got.imbalance_L, ref.imbalance_L)
            np.testing.assert_array_equal(got.bound_ratio_L, ref.bound_ratio_L)
            assert got.balancedness == ref.balancedness
            assert got.metrics() == ref.metrics()


def test_proven_bounds_are_numpys_to_the_bit(monkeypatch):
    """The same layers proven, with the same bound: greedy's counts, the uncapped optimum, and
    random counts (which the search for the fewest replicas starts far from)."""
    from planners.greedy import replicate

    rng = np.random.default_rng(2)
    for case in range(240):
        E, G = int(rng.integers(1, 40)), int(rng.integers(1, 9))
        S = int(rng.integers(-(-E // G), E + 1))
        P = G * S
        load = [np.floor(rng.pareto(0.8, (4, E)) * 10), rng.integers(0, 3, (4, E)).astype(float),
                rng.random((4, E)) * 1e6][case % 3]
        load[0] = 0.0
        random_LE = np.ones((4, E), dtype=np.int64)
        for row in random_LE:
            np.add.at(row, rng.integers(0, E, P - E), 1)
        want = stats.lower_bound(load, G, P)
        for count_LE in (replicate(load, P, G), replicate(load, P, P), random_LE):
            bound_L, proven_L = stats.proven_bound(load, count_LE, G, P)
            with monkeypatch.context() as m:
                _numpy_path(m)
                np_bound_L, np_proven_L = stats.proven_bound(load, count_LE, G, P)
            np.testing.assert_array_equal(proven_L, np_proven_L)
            np.testing.assert_array_equal(bound_L, np_bound_L)
            np.testing.assert_array_equal(bound_L[proven_L], want[proven_L])


def test_median_is_numpys():
    rng = np.random.default_rng(4)
    for n in (1, 2, 3, 58, 61, 94):
        a = rng.random(n)
        assert stats.median(a) == float(np.median(a))
    assert np.isnan(stats.median(np.array([1.0, np.nan, 2.0])))


def test_warm_up_compiles_the_only_kernel_versions_real_calls_use():
    """Read-only, float32 and strided loads, plans with migration, and both Rebalancer paths
    reach the kernels as the types warm_up compiled: a score never compiles on first use."""
    before = [len(f.signatures) for f in (kernel.bound_terms, kernel.even_report)]
    rng = np.random.default_rng(3)
    load = (rng.gamma(0.5, 1.0, (3, 64)) * 100).astype(np.float32)
    load.flags.writeable = False
    first = eplb.plan(load, num_gpus=8).placement
    for res in (eplb.plan(np.asfortranarray(load.astype(np.float64))[:, ::2], num_gpus=4, dispatch="even"),
                eplb.plan(load[::-1], num_gpus=8, previous=first)):
        assert 0 < res.placement.metrics["balancedness"] <= 1
    for policy in ("auto", None):
        rb = eplb.Rebalancer(first, interval=1, policy=policy, min_improvement=None if policy else 0.0)
        rb.observe(load[::-1].astype(np.float64))
        rb.rebalance()
    assert [len(f.signatures) for f in (kernel.bound_terms, kernel.even_report)] == before


def _run(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_kernels_load_from_a_processs_second_scored_plan():
    """A one-shot command scores its one plan in numpy (loading the kernels would cost it more),
    a process that plans again loads them, and a process without numba never imports them."""
    _run("""
        import sys
        import numpy as np
        import eplb
        from eplb import stats
        load = np.arange(1.0, 65.0).reshape(2, 32)
        eplb.plan(load, num_gpus=4).placement
        assert "numba" in sys.modules and "eplb.stats._score_kernel" not in sys.modules
        eplb.plan(load, num_gpus=4).placement
        assert stats.score_kernel() is not None
    """)
    _run("""
        import sys
        import numpy as np
        import eplb
        load = np.arange(1.0, 65.0).reshape(2, 32)
        for _ in range(3):
            eplb.plan(load, num_gpus=4, planner="contiguous").placement
        assert "numba" not in sys.modules and "eplb.stats._score_kernel" not in sys.modules
    """)


def test_plan_scores_match_whichever_path(monkeypatch):
    """PlanResult's reports and metrics are the same in both paths (a serving loop's numbers do
    not change when the kernels finish loading)."""
    rng = np.random.default_rng(5)
    load = np.floor(rng.pareto(1.2, (6, 64)) * 100) + 1
    res = eplb.plan(load, num_gpus=8, slots_per_gpu=9)
    with monkeypatch.context() as m:
        _numpy_path(m)
        ref = planning.PlanResult(res.solution, res.planner, res.seconds, res.load_LE, res.topology)
        want = (ref.placement.metrics, ref.lower_bound_L, ref.before.gpu_load_LG)
    got = (res.placement.metrics, res.lower_bound_L, res.before.gpu_load_LG)
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
