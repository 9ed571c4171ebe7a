"""Random placements and loads for tests (a helper module, not a test file)."""

from __future__ import annotations

import numpy as np

from eplb.core.placement import Placement


def spread_placement(rng, L: int = 3, E: int = 12, G: int = 4, N: int = 2, S: int = 4) -> Placement:
    """Every expert once (dealt round-robin in a random order), the other slots random replicas
    on GPUs that lack them (any node): a valid placement of L layers, G GPUs x S slots."""
    rows = []
    for _ in range(L):
        slots = [[] for _ in range(G)]
        for i, e in enumerate(rng.permutation(E)):
            slots[i % G].append(int(e))
        for g in range(G):
            while len(slots[g]) < S:
                e = int(rng.integers(E))
                if e not in slots[g]:
                    slots[g].append(e)
        rows.append([e for g in range(G) for e in slots[g]])
    return Placement(np.array(rows), G, E, N)


def skewed_counts(seed: int, L: int, E: int, tokens: int = 400_000) -> np.ndarray:
    """Skewed counts [L, E]: every layer's expert popularity drawn afresh from the seed
    (log-normal, sigma 1.2), then `tokens` tokens routed by it."""
    rng = np.random.default_rng(seed)
    p = rng.lognormal(0.0, 1.2, (L, E))
    p /= p.sum(axis=1, keepdims=True)
    return np.stack([rng.multinomial(tokens, q) for q in p]).astype(float)
