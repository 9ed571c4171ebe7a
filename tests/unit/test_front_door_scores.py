"""PlanResult's scores: the bound from a plan's replica counts is stats.lower_bound to the bit,
and the cached contiguous baseline is the one built afresh."""

import numpy as np
import pytest

from eplb import stats
from eplb.core.placement import contiguous_placement
from eplb.core.topology import Topology
from eplb.planning.front_door import lower_bound, plan
from planners import greedy


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("G,S", [(4, 5), (8, 3), (2, 8), (16, 1)])
def test_the_bound_from_a_plans_counts_is_the_numpy_bound(seed, G, S):
    """Layers where the counts are proven min-max optimal take their largest load per replica,
    the others are solved: either way the bits of stats.lower_bound."""
    rng = np.random.default_rng(seed)
    E = 16
    loads = [np.floor(rng.pareto(1.2, (6, E)) * 10),                # skewed, with ties
             rng.integers(0, 3, (6, E)).astype(np.float64),         # mostly ties and zeros
             np.zeros((2, E)), rng.gamma(0.5, 1e6, (6, E))]
    for load_LE in loads:
        want = stats.lower_bound(load_LE, G, G * S)
        np.testing.assert_array_equal(lower_bound(load_LE, Topology(G, S)), want)
        for count_LE in (greedy.replicate(load_LE, G * S, G), greedy.replicate(load_LE[:, ::-1], G * S, G)):
            np.testing.assert_array_equal(lower_bound(load_LE, Topology(G, S), count_LE), want)


def test_plans_of_one_shape_share_the_contiguous_baseline_and_score_it_the_same(rng):
    a, b = (rng.gamma(0.7, 100.0, (5, 32)) for _ in range(2))
    ra, rb = plan(a, num_gpus=8), plan(b, num_gpus=8)
    assert ra.before is not rb.before
    fresh = contiguous_placement(32, ra.topology, np.arange(5))
    for res, load_LE in ((ra, a), (rb, b)):
        want = stats.evaluate(fresh, load_LE)
        np.testing.assert_array_equal(res.before.gpu_load_LG, want.gpu_load_LG)
        np.testing.assert_array_equal(res.before.bound_ratio_L, want.bound_ratio_L)
