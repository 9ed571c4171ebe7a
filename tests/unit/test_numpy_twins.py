"""The whole-array numpy versions the kept kernels are timed against (benchmarks/bench_kernels.py)
give the kernels' results: greedy's three steps (tests/oracles/greedy.py) and the adaptive
policy's repair and window scores (tests/oracles/repair.py). Small shapes with many ties."""

from __future__ import annotations

import numpy as np
import pytest

from eplb import plan
from eplb.serving.repair import repair, window_imbalance
from planners import _greedy_kernel as kernel
from planners import greedy
from tests.oracles import greedy as numpy_greedy
from tests.oracles import repair as numpy_repair


def _loads(rng, kind, L, E):
    if kind == 0:
        return np.floor(rng.pareto(1.2, (L, E)) * 100) + 1
    if kind == 1:
        return rng.integers(0, 4, (L, E)).astype(float)
    return rng.random((L, E))


@pytest.mark.parametrize("seed", range(3))
def test_numpy_greedy_steps_are_the_kernels(seed):
    rng = np.random.default_rng(seed)
    for t in range(60):
        G, S = int(rng.integers(2, 12)), int(rng.integers(1, 6))
        P = G * S
        E = int(rng.integers(-(-P // G), P + 1))
        load = _loads(rng, t % 3, 4, E)
        count = greedy.replicate(load, P, G)
        np.testing.assert_array_equal(numpy_greedy.replicate(load, P, G), count)
        # Whole-number loads per replica from a small range: ties everywhere.
        per = rng.integers(1, 25, load.shape).astype(float) if t % 2 else load / count
        packed = greedy.pack_replicas(per, count, G, S)
        np.testing.assert_array_equal(numpy_greedy.pack(per, count, G, S), packed)
        for settle, cap, gap in ((True, 4 * P, 0.0), (False, 5, 0.0), (True, 4 * P, 1e-3)):
            a, b = packed.copy(), packed.copy()
            kernel.refine(a, per, G, cap, settle, gap)
            numpy_greedy.refine(b, per, G, cap, settle, gap)
            np.testing.assert_array_equal(b, a, err_msg=f"G={G} S={S} settle={settle} cap={cap}")


@pytest.mark.parametrize("seed", range(10))
def test_numpy_repair_is_the_kernels(seed):
    rng = np.random.default_rng(seed)
    G, S = [(4, 3), (8, 2), (6, 4), (16, 3), (12, 2)][seed % 5]
    E, L, M = G * S - int(rng.integers(0, G)), 5, int(rng.integers(1, 6))
    win = rng.gamma(0.5, 100.0, (M, L, E))
    start = plan(win.sum(axis=0) + 1, num_gpus=G, num_redundant=G * S - E, planner="greedy").placement.phy2log_LP
    win = win * rng.gamma(1.0, 1.0, win.shape)
    kw = dict(rounds_L=rng.integers(0, 10, L), partners=int(rng.integers(1, 10)))
    if seed % 3 == 1:
        kw.update(max_moves=float(rng.integers(1, 8)))
    if seed % 3 == 2:
        kw.update(max_moves_G=np.full(G, 2.0), weights_M=rng.integers(1, 4, M).astype(float))
    new, cost = repair(start, win, G, **kw)
    ref_new, ref_cost = numpy_repair.repair(start, win, G, **kw)
    np.testing.assert_array_equal(ref_new, new)
    np.testing.assert_allclose(ref_cost, cost, rtol=1e-12)
    np.testing.assert_array_equal(numpy_repair.window_imbalance(start, win, G), window_imbalance(start, win, G))
