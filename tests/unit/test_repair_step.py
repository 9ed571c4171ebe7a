"""The share-keeping repair's compiled search step (eplb/migration/_repair_kernel.py) picks the
swap its plain numpy reference (tests/oracles/repair.py) picks, on seeded layers with and
without tied loads."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.parametrize("seed", range(6))
def test_compiled_repair_step_is_the_numpy_step(seed):
    from eplb.migration.rule import _best_swap, _movable
    from tests.oracles.repair import _best_swap as numpy_best_swap

    rng = np.random.default_rng(seed)
    G, N, S, E = 8, 2 if seed % 2 else 1, 3, 16
    P = G * S
    for _ in range(20):
        phy_P = np.r_[rng.permutation(E), rng.integers(0, E, P - E)][rng.permutation(P)]
        x_P = rng.integers(0, 5, P).astype(float) if seed < 3 else rng.gamma(0.5, 10.0, P)  # ties, then none
        move_P = _movable(phy_P[None], G, N)[0]
        old_GE = rng.random((G, E)) < 0.3
        gpu_P = np.arange(P) // S
        args = (phy_P, x_P, move_P, old_GE, gpu_P, gpu_P // (G // N), G)
        assert _best_swap(*args) == numpy_best_swap(*args)
