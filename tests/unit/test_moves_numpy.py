"""The numpy twins of the move kernels (tests/oracles/moves_numpy.py) against the kernels.

Legend: L = MoE layers, E = logical experts, G = GPUs, N = nodes, S = slots per GPU, P = G x S.
"""

from __future__ import annotations

import numpy as np
import pytest

from eplb.migration import _moves_kernel as kernel
from tests.oracles import moves_numpy as twin


def _maps(seed, empties):
    """(G, S, N, E, old_LP, new_LP): random maps of 3 layers (experts -1 .. E - 1 with empties)."""
    rng = np.random.default_rng(seed)
    G, S = int(rng.integers(1, 9)), int(rng.integers(1, 5))
    E = int(rng.integers(1, 12)) if empties else int(rng.integers(1, G * S + 1))
    nodes = [d for d in range(1, G + 1) if G % d == 0]
    N = nodes[int(rng.integers(0, len(nodes)))]
    low = -1 if empties else 0
    return G, S, N, E, rng.integers(low, E, (3, G * S)), rng.integers(low, E, (3, G * S))


@pytest.mark.parametrize("seed", range(40))
def test_counting_twins_equal_the_kernels(seed):
    G, S, N, E, old, new = _maps(seed, empties=True)
    o, n = old.reshape(-1, S), new.reshape(-1, S)
    np.testing.assert_array_equal(twin.count_moves(o, n), kernel.count_moves(o, n))
    np.testing.assert_array_equal(twin.keep_slots(o, n), kernel.keep_slots(o, n))
    np.testing.assert_array_equal(twin.keep_counts(old, new, G, E), kernel.keep_counts(old, new, G, E))


@pytest.mark.parametrize("seed", range(40))
def test_matching_twins_equal_the_kernels(seed):
    """Maps without empties, as the renaming and its bound get (fresh plans)."""
    G, S, N, E, old, new = _maps(seed, empties=False)
    L = len(old)
    start, a, b, w = kernel.keep_pairs(old, new, G, E)
    start2, a2, b2, w2 = twin.keep_pairs(old, new, G, E)
    np.testing.assert_array_equal(start, start2)
    layer = np.repeat(np.arange(L), np.diff(start))
    order = np.argsort((layer * G + a) * G + b)
    np.testing.assert_array_equal(np.stack([a, b, w])[:, order], np.stack([a2, b2, w2]))
    np.testing.assert_array_equal(twin.fewest_moves(old, new, G, E), kernel.fewest_moves(old, new, G, E))
    np.testing.assert_array_equal(twin.match_gpus(old, new, G, E), kernel.match_gpus(old, new, G, E))
    out, out2 = np.empty_like(new), np.empty_like(new)
    kernel.rename_gpus(old, new, G, E, out)
    twin.rename_gpus(old, new, G, E, out2)
    np.testing.assert_array_equal(out2, out)
    # The GPU assignment: the same kept totals, a node's GPUs going to one old node.
    keep = kernel.keep_counts(old, new, G, E)
    got, ref = twin.gpu_assignment(keep, N), kernel.gpu_assignment(keep, N)
    kept = lambda src_LG: keep[np.arange(L)[:, None], src_LG, np.arange(G)[None, :]].sum(axis=1)  # noqa: E731
    np.testing.assert_array_equal(kept(got), kept(ref))
    assert (np.sort(got, axis=1) == np.arange(G)).all()
    n_ = G // N
    assert (got.reshape(L, N, n_) // n_ == (got.reshape(L, N, n_) // n_)[:, :, :1]).all()


@pytest.mark.parametrize("seed", range(20))
def test_matching_skips_empty_slots(seed):
    """Maps with empty slots (-1), which the public moves.fewest_moves / rename_gpus accept: the
    bound holds for every renaming, and the renaming only permutes whole GPUs."""
    from itertools import permutations

    G, S, N, E, old, new = _maps(seed, empties=True)
    G = min(G, 5)
    old, new = np.ascontiguousarray(old[:, :G * S]), np.ascontiguousarray(new[:, :G * S])
    L = len(old)
    bound = kernel.fewest_moves(old, new, G, E)
    np.testing.assert_array_equal(bound, twin.fewest_moves(old, new, G, E))
    o = old.reshape(-1, S)
    for perm in permutations(range(G)):
        renamed = new.reshape(L, G, S)[:, list(perm)].reshape(-1, S)
        assert (kernel.count_moves(o, renamed).reshape(L, G).sum(axis=1) >= bound).all()
    out = np.empty_like(new)
    kernel.rename_gpus(old, new, G, E, out)
    np.testing.assert_array_equal(kernel.match_gpus(old, new, G, E), twin.match_gpus(old, new, G, E))
    rows = lambda m: np.sort(np.sort(m.reshape(L, G, S), axis=2).reshape(L, G * S), axis=1)  # noqa: E731
    np.testing.assert_array_equal(rows(out), rows(new))
