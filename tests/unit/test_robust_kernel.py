"""The robust planners' compiled kernels give the numpy search's placements, and a cold cache
runs numpy (the same plan) while the kernels compile in the background."""

import numpy as np
import pytest

import eplb.core.jit
from eplb.core.topology import Topology
from eplb.stats.loads import replica_counts_minmax
from planners import _threads, robust
from planners.api import PlanRequest
from planners.robust import RobustPlanner, normalise_windows, pack_vector, robust_demand, smooth_max_swaps


def _packed(seed, T, L, E, G, S, blend=1.0):
    rng = np.random.default_rng(seed)
    h = np.floor(rng.pareto(1.2, (T, L, E)) * 100) + 1
    share = normalise_windows(h, G)
    count = replica_counts_minmax(robust_demand(share, blend), G * S, max_replicas=G)
    return share, count


# (seed, windows, layers, experts, GPUs, slots per GPU): many windows, one window (every
# pairing of a round costs the same then, so rounds pair in a seeded order; with 8 or more
# slots numpy sums a GPU's slots pairwise), one slot.
CASES = [(0, 6, 4, 32, 4, 9), (1, 6, 4, 32, 8, 5), (2, 1, 4, 32, 8, 5), (3, 1, 3, 64, 32, 3), (4, 5, 3, 32, 32, 1),
         (5, 1, 4, 64, 8, 9), (6, 12, 3, 32, 4, 9)]


@pytest.mark.parametrize("seed,T,L,E,G,S", CASES)
def test_compiled_packing_is_the_scipy_assignment(seed, T, L, E, G, S):
    share, count = _packed(seed, T, L, E, G, S)
    np.testing.assert_array_equal(pack_vector(share, count, G, S, compiled=True),
                                  pack_vector(share, count, G, S, compiled=False))


@pytest.mark.parametrize("seed,T,L,E,G,S", CASES)
@pytest.mark.parametrize("quantile,units", [(1.0, 1), (0.7, 1), (1.0, 2)])
def test_compiled_swaps_are_the_numpy_swaps(seed, T, L, E, G, S, quantile, units):
    share, count = _packed(seed, T, L, E, G, S)
    phy = pack_vector(share, count, G, S, compiled=False)
    w_LPT = np.take_along_axis(np.moveaxis(share / count[None], 0, 2), phy[:, :, None], axis=1)
    bound = np.random.default_rng(seed).random(phy.shape) < 0.3 if units > 1 else None
    runs = []
    for compiled in (False, True):
        p, w, b = phy.copy(), w_LPT.copy(), None if bound is None else bound.copy()
        ran = smooth_max_swaps(p, w, G, beta=50.0, max_rounds=100, quantile=quantile, num_units=units, bound_LP=b,
                               compiled=compiled)
        assert ran is compiled
        runs.append((p, w, b))
    (p0, w0, b0), (p1, w1, b1) = runs
    assert not np.array_equal(p0, phy) or S == 1  # the search did swap
    np.testing.assert_array_equal(p0, p1)
    np.testing.assert_array_equal(w0, w1)  # slot loads travel with their replicas
    if bound is not None:
        np.testing.assert_array_equal(b0, b1)


def test_kernels_work_on_arrays_they_cannot_write_in_place():
    share, count = _packed(0, 4, 3, 32, 4, 9)
    phy = pack_vector(share, count, 4, 9, compiled=False)
    w_LPT = np.take_along_axis(np.moveaxis(share / count[None], 0, 2), phy[:, :, None], axis=1)
    p0, w0 = phy.copy(), w_LPT.copy()
    smooth_max_swaps(p0, w0, 4, beta=50.0, max_rounds=50, compiled=False)
    p1, w1 = phy.astype(np.int32), np.asfortranarray(w_LPT)  # another dtype, another order: copied and back
    smooth_max_swaps(p1, w1, 4, beta=50.0, max_rounds=50, compiled=True)
    np.testing.assert_array_equal(p0, p1)
    np.testing.assert_array_equal(w0, w1)


def test_a_cold_cache_plans_in_numpy_while_the_kernels_compile_in_the_background(monkeypatch):
    share, _ = _packed(5, 4, 3, 32, 4, 9)
    request = PlanRequest(share.sum(axis=0), Topology(4, 9), history_TLE=share)
    warm = RobustPlanner().plan(request)
    assert warm.info["compiled"] is True and "numpy" not in warm.message

    started = []

    class FakePopen:
        def __init__(self, args, **kwargs):
            started.append(args)

        def wait(self):  # the reaper thread's (eplb.core.jit.compile_detached)
            return 0

    monkeypatch.setattr(robust, "_KERNELS", eplb.core.jit.CachedKernels(robust._KERNELS.module))
    monkeypatch.setattr(eplb.core.jit, "load_cached", lambda modules: False)
    monkeypatch.setattr(eplb.core.jit.subprocess, "Popen", FakePopen)
    cold = RobustPlanner().plan(request)
    assert cold.info["compiled"] is False and "numpy" in cold.message
    np.testing.assert_array_equal(cold.phy2log_LP, warm.phy2log_LP)
    assert len(started) == 1 and "planners._robust_kernel" in started[0][-1]  # one compile, however many calls


def test_kernel_sums_add_in_numpys_order():
    from planners import _robust_kernel

    rng = np.random.default_rng(0)
    for n in [1, 7, 8, 9, 16, 127, 128, 129, 300, 1000, 4099]:
        a = rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 6, n)  # terms of many sizes: order shows
        assert _robust_kernel._pairwise(a, 0, n, 1) == np.add.reduce(a)


def test_one_window_packing_with_an_expert_on_every_gpu():
    # One expert takes a replica on each of the 8 GPUs, straddling rounds: the seeded in-order
    # pairing must still keep replicas of one expert on distinct GPUs, compiled or not.
    share = normalise_windows(np.array([[[400.0] + [1.0 + i for i in range(23)]]]), 8)
    count = replica_counts_minmax(robust_demand(share, 0.0), 8 * 4, max_replicas=8)
    assert count[0, 0] == 8
    phy = pack_vector(share, count, 8, 4, compiled=True)
    np.testing.assert_array_equal(phy, pack_vector(share, count, 8, 4, compiled=False))
    for g in range(8):
        assert len(set(phy[0, g * 4:(g + 1) * 4])) == 4
    np.testing.assert_array_equal(np.bincount(phy[0], minlength=24), count[0])


def test_swap_search_on_threads_is_the_numpy_search(monkeypatch):
    # Blocks of layers searched on threads (views of the same arrays) make numpy's swaps.
    share, count = _packed(7, 5, 7, 32, 8, 5)
    phy = pack_vector(share, count, 8, 5, compiled=False)
    w_LPT = np.take_along_axis(np.moveaxis(share / count[None], 0, 2), phy[:, :, None], axis=1)
    p0, w0 = phy.copy(), w_LPT.copy()
    smooth_max_swaps(p0, w0, 8, beta=50.0, max_rounds=100, compiled=False)
    monkeypatch.setattr(_threads, "num_blocks", lambda num_rows, num_cells: 3)
    p1, w1 = phy.copy(), w_LPT.copy()
    assert smooth_max_swaps(p1, w1, 8, beta=50.0, max_rounds=100, compiled=True)
    assert not np.array_equal(p0, phy)
    np.testing.assert_array_equal(p0, p1)
    np.testing.assert_array_equal(w0, w1)


@pytest.mark.parametrize("T", [1, 5])
def test_packing_on_threads_is_the_scipy_packing(monkeypatch, T):
    # Blocks of layers packed on threads, each block's placements written into its rows.
    share, count = _packed(8, T, 7, 32, 8, 5)
    expected = pack_vector(share, count, 8, 5, compiled=False)
    monkeypatch.setattr(_threads, "num_blocks", lambda num_rows, num_cells: 3)
    np.testing.assert_array_equal(pack_vector(share, count, 8, 5, compiled=True), expected)


def test_swaps_reuse_no_stale_pair_on_many_gpus():
    # 16 GPUs and top_gpus = 2: many rounds keep the peak, and the kernel then reuses the best
    # swaps of GPU pairs that did not change; the swaps must still be numpy's, round by round.
    share, count = _packed(9, 8, 3, 64, 16, 5)
    phy = pack_vector(share, count, 16, 5, compiled=False)
    w_LPT = np.take_along_axis(np.moveaxis(share / count[None], 0, 2), phy[:, :, None], axis=1)
    for rounds in (3, 10, 100):  # a search cut short ends where numpy's does
        p0, w0, p1, w1 = phy.copy(), w_LPT.copy(), phy.copy(), w_LPT.copy()
        smooth_max_swaps(p0, w0, 16, beta=50.0, max_rounds=rounds, compiled=False)
        smooth_max_swaps(p1, w1, 16, beta=50.0, max_rounds=rounds, compiled=True)
        np.testing.assert_array_equal(p0, p1)


@pytest.mark.parametrize("T", [1, 4])
def test_planning_calls_the_kernels_with_the_warm_ups_signature(T):
    # The warm-up loads one signature per kernel, of C-ordered arrays: a plan that called one
    # with other strides would compile it (seconds) in the middle of a command or a decision.
    from planners import _robust_kernel

    share, _ = _packed(10, T, 3, 32, 4, 9)
    RobustPlanner().plan(PlanRequest(share.sum(axis=0), Topology(4, 9), history_TLE=share))
    for kernel in (_robust_kernel.pack_vector, _robust_kernel.smooth_max_swaps):
        for signature in kernel.signatures:
            assert all(getattr(arg, "layout", "C") == "C" for arg in signature), (kernel, signature)
