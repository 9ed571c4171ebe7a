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
