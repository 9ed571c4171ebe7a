"""The search's local scores (eplb.planning.resplit_local): each is the busiest GPU of a feasible
split of the changed map, so never below its exact re-split optimum, and the colour-class
water-filling reaches the same optimum as the oracle."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb.dispatch.resplit_score import (
    NETWORK_GPUS,
    TOL,
    _network,
    colour_classes,
    even_split,
    fixed_loads,
    flexible_loads,
    layout,
    resplit_imbalance,
    water_fill,
)
from eplb.planning import resplit_repair as rr
from eplb.planning.resplit_local import _first_true, score_local
from tests.oracles.resplit import hall_busiest, water_fill_reference


def _case(rng, L, E, G, S, M=4):
    rows = [rng.permutation(np.r_[np.arange(E), rng.integers(0, E, G * S - E)]) for _ in range(L)]
    p = rng.gamma(0.7, 1.0, (L, E))
    win = np.stack([np.stack([rng.multinomial(3000, q / q.sum()) for q in p]) for _ in range(M)]).astype(float)
    return np.stack(rows), win


def _changed_maps(phy_LP, cand):
    new = phy_LP[cand[:, 0]].copy()
    rr._apply(new, np.c_[np.arange(len(cand)), cand[:, 1:]])
    return new


@pytest.mark.parametrize("seed,G,S,E,hops", [(0, 4, 3, 10, 0), (1, 6, 2, 9, 1), (2, 16, 3, 40, 2), (3, 32, 2, 48, 1)])
def test_local_scores_are_upper_bounds_of_the_exact_optimum(seed, G, S, E, hops):
    rng = np.random.default_rng(seed)
    phy, win = _case(rng, 3, E, G, S)
    load, w_M = rr.scenarios(win, G)
    state = rr._score(phy, load, G, w_M)
    L = len(phy)
    cand = rr._candidates(phy, np.arange(L), np.full(L, 1), state[1][:, :, :G], state[2], load, w_M, G)
    assert len(cand)
    busiest_MC = score_local(cand, phy, state[0], state[1], load, G, hops, 4)
    new_CP = _changed_maps(phy, cand)
    for c in range(len(cand)):
        exact_M = resplit_imbalance(new_CP[c:c + 1], load[:, cand[c, 0]][:, None], G)[:, 0]
        mean_M = load[:, cand[c, 0]].sum(axis=1) / G
        assert (busiest_MC[:, c] / mean_M >= exact_M - TOL).all()
    # No candidate puts an expert twice on one GPU where it was not twice before.
    for c, row in enumerate(new_CP):
        was = phy[cand[c, 0]]
        twice_new = np.bincount(row * G + np.arange(len(row)) // S, minlength=E * G) > 1
        twice_was = np.bincount(was * G + np.arange(len(was)) // S, minlength=E * G) > 1
        assert not (twice_new & ~twice_was).any()


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 8), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_colour_classes_share_no_gpu_and_cover_every_expert(g, s, seed):
    rng = np.random.default_rng(seed)
    e = max(1, g * s - int(rng.integers(0, g * s)))
    phy = np.stack([rng.permutation(np.r_[np.arange(e), rng.integers(0, e, g * s - e)]) for _ in range(3)])
    lay = layout(phy, g)
    B, R, _ = lay.gpu_BRX.shape
    seen = np.zeros((B, R), dtype=int)
    for k_BK in colour_classes(lay.gpu_BRX, g):
        for b in range(B):
            real = k_BK[b][k_BK[b] < R]
            seen[b, real] += 1
            gpus = lay.gpu_BRX[b, real].ravel()
            gpus = gpus[gpus < g]
            assert len(gpus) == len(set(gpus.tolist()))
    assert (seen == 1).all()
    load = rng.gamma(0.5, 1.0, (2, 3, e))
    np.testing.assert_allclose(resplit_imbalance(phy, load, g), hall_busiest(phy, load, g), atol=TOL)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 12), st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_water_fill_pours_exactly_as_one_expert_at_a_time(g, s, sweeps, seed):
    """The vectorised pour (sorting networks, windows last) gives the flows and GPU loads of the
    plain-Python pour to the last bit, from the even split and from a warm split."""
    rng = np.random.default_rng(seed)
    e = max(1, g * s - int(rng.integers(0, g * s)))
    phy = np.stack([rng.permutation(np.r_[np.arange(e), rng.integers(0, e, g * s - e)]) for _ in range(3)])
    load = rng.gamma(0.7, 1.0, (2, 3, e)) * 100
    lay = layout(phy, g)
    fixed, flex = fixed_loads(lay, load), flexible_loads(lay, load)
    gpu, flow = even_split(lay, fixed, flex)
    water_fill(lay.gpu_BRX, flex, gpu, flow, 1)                   # a warm start for the second pass
    for _ in range(2):
        want_gpu, want_flow = gpu.copy(), flow.copy()
        water_fill_reference(lay.gpu_BRX, flex, want_gpu, want_flow, sweeps, colour_classes(lay.gpu_BRX, g))
        water_fill(lay.gpu_BRX, flex, gpu, flow, sweeps)
        assert np.array_equal(gpu[:, :, :g], want_gpu[:, :, :g]) and np.array_equal(flow, want_flow)


@pytest.mark.parametrize("n", range(1, NETWORK_GPUS + 1))
def test_sorting_networks_sort_every_zero_one_input(n):
    """A comparator network that sorts every 0/1 input sorts every input (the 0-1 principle)."""
    for bits in itertools.product((0.0, 1.0), repeat=n):
        got = list(np.array(bits)[:, None])
        for i, j in _network(n):
            got[i], got[j] = np.minimum(got[i], got[j]), np.maximum(got[i], got[j])
        assert [float(v[0]) for v in got] == sorted(bits)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_first_true_keeps_what_a_stable_argsort_keeps(n, z, seed):
    rng = np.random.default_rng(seed)
    mask = rng.random((n, 3, z)) < rng.random()
    y = max(1, int(mask.sum(axis=2).max()) - int(rng.integers(0, 2)))
    order = np.argsort(~mask, axis=2, kind="stable")[:, :, :y]
    want = np.where(np.take_along_axis(mask, order, axis=2), order, -7)
    assert np.array_equal(_first_true(mask, y, -7), want)
