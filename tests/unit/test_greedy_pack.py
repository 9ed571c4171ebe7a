"""greedy's packing kernel against its plain-Python twin (tests/oracles/pack.py).

The kernel runs S cheap rounds while they place every replica where longest-processing-time
would, and LPT itself from the first replica where they part; a row LPT cannot finish (an
expert with more replicas than GPUs with free slots) is packed in rounds. Loads with many ties
and zero loads make the rounds part from LPT early and often.
"""

from __future__ import annotations

import numpy as np
import pytest

from planners.greedy import pack_replicas, replicate
from tests.oracles import pack as oracle


def _rows(seed: int, n: int):
    rng = np.random.default_rng(seed)
    for t in range(n):
        G, S = int(rng.integers(1, 12)), int(rng.integers(1, 6))
        P = G * S
        E = int(rng.integers(-(-P // G), P + 1))
        kind = t % 4
        if kind == 0:
            load_LE = np.floor(rng.pareto(1.2, (3, E)) * 100) + 1
        elif kind == 1:
            load_LE = rng.integers(0, 4, (3, E)).astype(float)
        elif kind == 2:
            load_LE = rng.random((3, E))
        else:
            load_LE = np.floor(rng.pareto(0.6, (3, E)) * 10)
        count_LE = replicate(load_LE, P, G)
        yield load_LE / count_LE, count_LE, G, S


@pytest.mark.parametrize("seed", [0, 1])
def test_pack_is_lpt_or_rounds_where_lpt_is_stuck(seed):
    parted = 0
    for per_LE, count_LE, G, S in _rows(seed, 600):
        got = pack_replicas(per_LE, count_LE, G, S)
        for r in range(per_LE.shape[0]):
            want = oracle.lpt(per_LE[r], count_LE[r], G, S)
            if want is None:  # rare here: see the next test
                want = oracle.rounds(per_LE[r], count_LE[r], G, S)
            elif want != oracle.rounds(per_LE[r], count_LE[r], G, S):
                parted += 1
            assert got[r].tolist() == want, (G, S, per_LE[r].tolist(), count_LE[r].tolist())
    assert parted > 100  # rows where the kernel leaves its rounds for LPT


def test_a_row_lpt_cannot_finish_is_packed_in_rounds():
    # LPT fills GPUs 1 and 2 with the light replicas beside the heavy expert 0 on GPU 0, and the
    # last expert's two replicas find one GPU with free slots; the rounds leave one slot each.
    per_E = np.array([[100.0, 1.0, 1.0, 0.9, 0.9, 0.8, 0.8, 0.5]])
    count_E = np.array([[1, 1, 1, 1, 1, 1, 1, 2]])
    assert oracle.lpt(per_E[0], count_E[0], 3, 3) is None
    assert pack_replicas(per_E, count_E, 3, 3).tolist() == [[0, 5, 7, 1, 3, 6, 2, 4, 7]]
