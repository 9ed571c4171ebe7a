"""Shapes of topic shift (eplb.stats.topic_shifts) and the adaptive policy's drift test."""

import numpy as np
import pytest

from eplb.cli import main
from eplb.errors import EplbError
from eplb.serving.horizons import DriftTest
from eplb.stats.synth import generate, shaped_settings
from eplb.stats.topic_shifts import SHIFT_SHAPES, segment_shares

SMALL = dict(num_windows=12, tokens_per_window=256, num_hidden_layers=4, first_moe_layer=1, num_experts=16,
             top_k=2, num_expert_groups=1, topk_groups=1, topic_shifts=2, topic_hot=(0.2, 0.3))


def test_segment_shares_sum_to_one_and_ramp():
    share_TU = segment_shares(10, np.array([3.0, 6.5]), 0)
    assert np.allclose(share_TU.sum(axis=1), 1.0)
    assert share_TU[2, 0] == 1.0 and share_TU[3, 1] == 1.0 and np.isclose(share_TU[6, 1], 0.5)
    ramp_TU = segment_shares(10, np.array([3.0]), 4)
    assert np.allclose(ramp_TU.sum(axis=1), 1.0) and (np.diff(ramp_TU[:, 1]) >= 0).all()


@pytest.mark.parametrize("shape", ["gradual", "recurring", "inside"])
def test_each_shape_is_seeded(shape):
    a = generate(shaped_settings(shape, **SMALL, seed=3))
    b = generate(shaped_settings(shape, **SMALL, seed=3))
    assert (a.counts_TLE == b.counts_TLE).all() and a.meta["topic_shifts"]


def test_unknown_shape_names_the_choices():
    with pytest.raises(EplbError, match="gradual"):
        shaped_settings("sideways")
    assert set(SHIFT_SHAPES) == {"abrupt", "gradual", "recurring", "inside", "local"}


def test_drift_test_tells_a_shift_from_noise():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(16), size=2)
    noise = np.stack([[rng.multinomial(4000, p[0])] for _ in range(12)]).astype(float)
    shifted = np.stack([[rng.multinomial(4000, p[0 if t < 9 else 1])] for t in range(12)]).astype(float)
    d = DriftTest()
    assert d.horizon(noise) is None
    assert d.horizon(shifted) is not None and d.horizon(shifted)[0] == 2
    with pytest.raises(EplbError, match="drift_reference"):
        DriftTest(horizons=(8,), reference=8)


def test_cli_topic_shape(tmp_path):
    out = tmp_path / "t.npz"
    assert main(["synth", "-o", str(out), "--topic-shape", "gradual", "--windows", "12", "--experts", "16",
                 "--top-k", "2", "--hidden-layers", "4", "--first-moe-layer", "1", "--tokens", "256", "--quiet"]) == 0
    assert out.is_file()


def test_swap_price_keeps_only_swaps_that_pay_for_their_moves():
    """A swap must lower the smooth maximum by the price of its two moves: a price above any
    swap's drop leaves the fills alone, and no price lowers the moves of drifting decisions."""
    from eplb.core.topology import Topology
    from eplb.evaluate.replay import replay
    from eplb.migration import count_moves
    from eplb.serving.repair import repair

    rng = np.random.default_rng(1)
    G, E, S = 4, 16, 5
    start_LP = np.concatenate([np.arange(E), rng.integers(0, E, G * S - E)])[None]
    win_MLE = rng.gamma(0.5, size=(3, 1, E)) * 100
    rounds_L = np.array([8])
    free, _ = repair(start_LP, win_MLE, G, rounds_L=rounds_L)
    fills, _ = repair(start_LP, win_MLE, G, rounds_L=np.array([0]))
    priced, _ = repair(start_LP, win_MLE, G, rounds_L=rounds_L, swap_price=10.0)
    assert (priced == fills).all() and not (free == fills).all()
    trace = generate(shaped_settings("abrupt", **{**SMALL, "num_windows": 20}, seed=2)).counts_TLE
    topo = Topology(4, 5)
    moves = [replay(trace, topology=topo, settings={"drift_swap_price": p}, references=()).summary()
             ["moves_per_window_share_of_slots"] for p in (0.0, 1.0)]
    assert moves[1] <= moves[0]
    with pytest.raises(EplbError, match="drift_swap_price"):
        replay(trace, topology=topo, settings={"drift_swap_price": -1.0}, references=())
    assert count_moves(start_LP, priced, G, E).sum() <= count_moves(start_LP, free, G, E).sum()
