"""greedy's swap refinement (planners/_greedy_kernel.py `refine`): its kept orders are the fresh ones.

The kernel keeps each GPU's replicas sorted and the GPUs sorted by load across swaps, updating
only what a swap moves. Running k swaps at once must therefore equal k calls of one swap each
(every call sorts from scratch), and each swap must be the one its rule picks, found here by
trying every swap: the lowest larger load of the pair; when settling, the lighter GPUs in load
order, each with its lowest, and the first whose lowest is at or below the second-busiest GPU
(else the lowest of all).
"""

from __future__ import annotations

import numpy as np
import pytest

import eplb
from eplb import stats
from planners import _greedy_kernel as kernel
from planners.greedy import pack_replicas, plan_greedy, replicate


def _case(rng, L: int, G: int, S: int, E: int, ties: bool):
    """(per_LE, phy2log_LP) packed by greedy. Each replica's load is a whole number, so every
    sum is exact: the kernel's running GPU loads equal fresh sums, and any difference between
    kept and fresh orders is an ordering bug, not rounding."""
    load_LE = np.floor(rng.pareto(1.2, (L, E)) * 100) + 1
    count_LE = replicate(load_LE, G * S, G)
    per_LE = (rng.integers(1, 25, (L, E)) if ties else np.ceil(load_LE / count_LE)).astype(float)
    return per_LE, pack_replicas(per_LE, count_LE, G, S)


def _best_pair_max(phy_P: np.ndarray, per_E: np.ndarray, G: int, S: int, settle: bool) -> float:
    """The larger load of the pair after the swap the rule picks, or the busiest load when no
    swap lowers it (every pair tried; S <= 8 slots, so numpy sums a GPU's loads in slot order,
    as the kernel does). GPUs in the kernel's order: load ascending, lower index among ties."""
    gpu_GS = phy_P.reshape(G, S)
    load_G = per_E[gpu_GS].sum(axis=1)
    order = np.lexsort((np.arange(G), load_G))
    h = order[-1]                                   # the kernel's busiest: the highest index among ties
    second = load_G[order[-2]]
    best = load_G[h]
    for g in order[:-1]:
        for ea in gpu_GS[h]:
            for eb in gpu_GS[g]:
                d = per_E[ea] - per_E[eb]
                if d <= 0 or eb in gpu_GS[h] or ea in gpu_GS[g]:
                    continue
                best = min(best, max(load_G[h] - d, load_G[g] + d))
        if settle and best <= second and best < load_G[h] * (1 - 1e-9):
            break                                   # this GPU's swap leaves the pair below the second-busiest
    return best


@pytest.mark.parametrize("settle", [False, True])
@pytest.mark.parametrize("seed, G, S, E, ties", [(0, 8, 5, 32, False), (1, 8, 5, 32, True), (2, 6, 8, 40, True),
                                                 (3, 16, 3, 40, False), (4, 5, 7, 30, True)])
def test_k_swaps_at_once_are_k_single_swaps(seed, G, S, E, ties, settle):
    per_LE, phy_LP = _case(np.random.default_rng(seed), 8, G, S, E, ties)
    at_once = phy_LP.copy()
    made = kernel.refine(at_once, per_LE, G, 30, settle, 0.0)
    assert made > 0
    one_by_one = phy_LP.copy()
    for _ in range(30):
        kernel.refine(one_by_one, per_LE, G, 1, settle, 0.0)
    np.testing.assert_array_equal(at_once, one_by_one)


@pytest.mark.parametrize("settle", [False, True])
def test_kept_orders_hold_on_tie_heavy_shapes(settle):
    """Few distinct loads: many replicas weigh the same, and only the tie rules pick among them
    (an order kept with a wrong tie rule shows in a few of these shapes)."""
    rng = np.random.default_rng(0)
    checked = 0
    while checked < 150:
        E, G = int(rng.integers(4, 40)), int(rng.integers(2, 12))
        if -(-E // G) > min(E, 12):
            continue
        S = int(rng.integers(-(-E // G), min(E, 12) + 1))
        per_LE, phy_LP = _case(rng, 5, G, S, E, ties=True)
        at_once, one_by_one = phy_LP.copy(), phy_LP.copy()
        made = kernel.refine(at_once, per_LE, G, 4 * G * S, settle, 0.0)
        for _ in range(made):
            kernel.refine(one_by_one, per_LE, G, 1, settle, 0.0)
        np.testing.assert_array_equal(at_once, one_by_one, err_msg=f"E={E} G={G} S={S}")
        checked += 1


@pytest.mark.parametrize("settle", [False, True])
@pytest.mark.parametrize("seed, ties, G, S, E", [(5, False, 6, 5, 24), (6, True, 6, 5, 24), (6, False, 6, 5, 24),
                                                 (6, False, 8, 4, 24), (5, False, 10, 4, 30)])
def test_each_swap_is_the_one_its_rule_picks(seed, ties, G, S, E, settle):
    per_LE, phy_LP = _case(np.random.default_rng(seed), 4, G, S, E, ties)
    for layer in range(per_LE.shape[0]):
        per_E, phy = per_LE[layer:layer + 1], phy_LP[layer:layer + 1].copy()
        for _ in range(8):
            load_G = per_E[0][phy[0].reshape(G, S)].sum(axis=1)
            best = _best_pair_max(phy[0], per_E[0], G, S, settle)
            if kernel.refine(phy, per_E, G, 1, settle, 0.0) == 0:
                assert best >= load_G.max() * (1 - 1e-9)   # no swap lowers the busiest GPU
                break
            after_G = per_E[0][phy[0].reshape(G, S)].sum(axis=1)
            moved = np.flatnonzero(np.abs(after_G - load_G) > 1e-12)
            assert len(moved) == 2 and after_G[moved].max() == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed, G, S, E", [(7, 8, 5, 32), (8, 16, 3, 40), (9, 32, 9, 256)])
def test_a_gap_stops_the_same_swaps_early(seed, G, S, E):
    """Swaps are made in the same order whatever the gap: a row refined with a gap is the row
    refined to the floor, stopped at its first swap within the gap (or the same row, when that
    never comes)."""
    per_LE, phy_LP = _case(np.random.default_rng(seed), 12, G, S, E, ties=False)
    gap = 1e-3
    floor_L = np.maximum(per_LE[np.arange(12)[:, None], phy_LP].sum(axis=1) / G, per_LE.max(axis=1))
    stopped = phy_LP.copy()
    kernel.refine(stopped, per_LE, G, 4 * G * S, True, gap)
    for layer in range(12):
        per_E = per_LE[layer:layer + 1]
        row = phy_LP[layer:layer + 1].copy()
        while per_E[0][row[0].reshape(G, S)].sum(axis=1).max() > floor_L[layer] * (1 + gap + 1e-12):
            if kernel.refine(row, per_E, G, 1, True, 0.0) == 0:
                break
        np.testing.assert_array_equal(stopped[layer], row[0])


def test_the_greedy_planner_takes_the_gap_and_refine_gap_0_refines_to_the_floor():
    import eplb
    from planners.greedy import REFINE_GAP, plan_greedy

    load_LE = np.floor(np.random.default_rng(3).pareto(1.2, (6, 64)) * 1000) + 1
    default = eplb.plan(load_LE, num_gpus=8, slots_per_gpu=9, planner="greedy")
    np.testing.assert_array_equal(default.solution.phy2log_LP, plan_greedy(load_LE, 8, 9, refine_gap=REFINE_GAP))
    exact = eplb.plan(load_LE, num_gpus=8, slots_per_gpu=9, planner="greedy", settings={"refine_gap": 0})
    np.testing.assert_array_equal(exact.solution.phy2log_LP, plan_greedy(load_LE, 8, 9))
    # Each layer stopped within the gap of its floor, or refined as far as the exact plan.
    busiest_L, exact_L = default.after.gpu_load_LG.max(axis=1), exact.after.gpu_load_LG.max(axis=1)
    count_LE = exact.placement.replica_count_LE
    floor_L = np.maximum(load_LE.sum(axis=1) / 8, (load_LE / count_LE).max(axis=1))
    assert np.all((busiest_L <= floor_L * (1 + REFINE_GAP + 1e-9)) | (busiest_L == exact_L))
    assert np.all(exact_L <= busiest_L) and (exact_L < busiest_L).any()  # the gap stopped some layer early


@pytest.mark.parametrize("G, S", [(4, 9), (8, 5), (16, 3)])
def test_greedy_refinement_never_raises_the_busiest_gpu(G, S):
    rng = np.random.default_rng(G)
    load = np.floor(rng.gamma(2.0, 100.0, (6, 32))) + 1
    packed = plan_greedy(load, G, S, refine_rounds=0)
    refined = plan_greedy(load, G, S)
    busiest = lambda phy: eplb.Placement(phy, G, 32).gpu_loads(load).max(axis=1)  # noqa: E731
    assert (busiest(refined) <= busiest(packed) + 1e-9).all()
    assert (busiest(refined) < busiest(packed) - 1e-9).any()
    lb = stats.lower_bound(load, G, G * S)
    assert (busiest(refined) >= lb - 1e-9).all()
