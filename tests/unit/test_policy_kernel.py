"""The adaptive policy's compiled steps (eplb/serving/_policy_kernel.py) against their references: the
ends of the GPU order a swap round reads, the targets' heap, and the whole repair on one window
and on more GPUs than the partners a swap may reach."""

import numpy as np
import pytest

from eplb import plan
from eplb.core.jit import kernel
from eplb.serving import _policy_kernel, _swaps_kernel
from eplb.serving.repair import repair
from eplb.stats.loads import replica_counts_minmax
from tests.oracles import policy as oracle


@kernel
def _full_order(peak_G):
    order_G = np.empty(peak_G.shape[0], dtype=np.int64)
    _swaps_kernel._rank(peak_G, order_G)
    return order_G


@kernel
def _end_order(peak_G, n_top, n_bottom):
    order_G = np.full(peak_G.shape[0], -1, dtype=np.int64)
    _swaps_kernel._rank_ends(peak_G, order_G, n_top, n_bottom)
    return order_G


@kernel
def _counts(share_EM, blend, P, G):
    E = share_EM.shape[0]
    key_E, r_E = np.empty(E), np.empty(E, dtype=np.int64)
    _policy_kernel._demand(share_EM, np.ones(share_EM.shape[1]), blend, key_E)
    _policy_kernel._targets(key_E, P, G, r_E, np.empty(E), np.empty(E, dtype=np.int64))
    return r_E


@pytest.mark.parametrize("seed", range(4))
def test_rank_ends_are_the_ends_of_the_full_order(seed):
    """Ties (whole-number peaks) included: heaviest first, the lower GPU first among equals."""
    rng = np.random.default_rng(seed)
    for _ in range(200):
        G = int(rng.integers(1, 40))
        peak_G = rng.integers(0, 4, G).astype(float) if seed % 2 else rng.random(G)
        n_top, n_bottom = int(rng.integers(0, 4)), int(rng.integers(0, 10))
        full, ends = _full_order(peak_G), _end_order(peak_G, n_top, n_bottom)
        if n_top + n_bottom > G:
            np.testing.assert_array_equal(ends, full)
        else:
            np.testing.assert_array_equal(ends[:n_top], full[:n_top])
            np.testing.assert_array_equal(ends[G - n_bottom:], full[G - n_bottom:])


@pytest.mark.parametrize("seed", range(4))
def test_targets_match_the_minmax_counts(seed):
    """The heap gives `replica_counts_minmax(demand, P, max_replicas=G)`, ties and caps included."""
    rng = np.random.default_rng(seed)
    E, M = 24, 3
    for G, S in [(4, 8), (8, 5), (2, 20), (24, 2)]:
        share_EM = rng.integers(0, 3, (E, M)).astype(float) if seed % 2 else rng.gamma(0.5, 1.0, (E, M))
        for blend in (0.0, 1.0):
            demand_E = share_EM.mean(axis=1) + blend * (share_EM.max(axis=1) - share_EM.mean(axis=1))
            ref_E = replica_counts_minmax(demand_E[None], G * S, max_replicas=G)[0]
            np.testing.assert_array_equal(_counts(share_EM, blend, G * S, G), ref_E)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("windows", [1, 3])
def test_repair_matches_the_reference_beyond_the_partners(seed, windows):
    """More GPUs than partners (the swap rounds read only the ends of the order) and one window
    (every blend has the same targets: one fill made), slot by slot against tests/oracles/policy.py."""
    rng = np.random.default_rng(seed)
    Lr, Er, Gr, Sr = 2, 20, 10, 3
    p = rng.gamma(1.0, 1.0, (Lr, Er))
    win = np.stack([rng.poisson(300 * p * rng.gamma(3, 1 / 3, (Lr, Er))) for _ in range(windows)]).astype(float)
    start = plan(rng.gamma(1.0, 1.0, (Lr, Er)), num_gpus=Gr, slots_per_gpu=Sr).placement.phy2log_LP
    kw = dict(rounds_L=np.array([4, 9]), partners=3)
    if seed % 2:
        kw.update(max_moves=5.0, max_moves_G=np.full(Gr, 2.0))
    new, cost = repair(start, win, Gr, **kw)
    ref_new, ref_cost = oracle.repair(start, win, Gr, **kw)
    np.testing.assert_array_equal(new, ref_new)
    np.testing.assert_allclose(cost, ref_cost, rtol=0, atol=1e-12)
