"""Fitting a profile to shim measurements (eplb.dispatch.calibration), on measurements made from a known one."""

from __future__ import annotations

import numpy as np
import pytest

from eplb.core.hardware import Hardware
from eplb.dispatch.calibration import ShimMeasurements, fit_profile, predicted_compute
from eplb.errors import EplbError


def _measurements(hw: Hardware, C=12, noise=0.02, seed=0) -> ShimMeasurements:
    """Rows per slot drawn at several batch sizes; times from `hw` through the cost model, plus noise."""
    rng = np.random.default_rng(seed)
    B, L, G, S = 3, 2, 4, 6
    tokens = np.resize([1, 4, 16, 64], C)
    rows = np.stack([rng.poisson(t * 4 / S, (B, L, G, S)) * (rng.random((B, L, G, S)) < 0.8) for t in tokens])
    m = ShimMeasurements(tuple(f"case {i}" for i in range(C)), tokens, rows.astype(float), np.zeros((C, B, L, G)),
                         np.zeros((C, B, L, G)), np.zeros((C, B, L, G)), rows.sum(axis=4).astype(float),
                         hidden=256, expert_hidden=512, num_logical_experts=24, top_k=4)
    from eplb.dispatch.calibration import CostModel

    cost = CostModel(m.model(), hw, expert_dtype="fp32", dispatch_dtype="fp32", combine_dtype="fp32")
    compute = cost.replica_seconds(rows).sum(axis=4) * (1 + noise * rng.standard_normal((C, B, L, G)))
    sent = rows.sum(axis=4)[:, :, :, ::-1].astype(float)
    a2a = hw.a2a_latency_s * 2 + np.maximum(sent, m.received_CBLG) * m.row_bytes_moved / hw.nvlink_bytes_per_s
    return ShimMeasurements(m.names, tokens, m.rows_CBLGS, compute, a2a, sent, m.received_CBLG, 256, 512, 24, 4)


def test_fit_recovers_the_constants_it_was_made_from():
    truth = Hardware("truth", {"fp32": 2e10}, hbm_bytes_per_s=5e9, nvlink_bytes_per_s=2e8, internode_bytes_per_s=2e8,
                     expert_overhead_s=5e-5, a2a_latency_s=1e-4)
    m = _measurements(truth)
    hw, rep = fit_profile(m)
    assert rep["r2_compute"] > 0.99 and rep["r2_compute_held_out"] > 0.98 and rep["r2_all_to_all"] > 0.99
    assert hw.flops("fp32") == pytest.approx(2e10, rel=0.1)
    assert hw.hbm_bytes_per_s == pytest.approx(5e9, rel=0.1)
    assert hw.expert_overhead_s == pytest.approx(5e-5, rel=0.2)
    assert hw.nvlink_bytes_per_s == pytest.approx(2e8, rel=0.01) and hw.a2a_latency_s == pytest.approx(1e-4, rel=0.01)
    np.testing.assert_allclose(predicted_compute(m, hw), predicted_compute(m, truth), rtol=0.05)
    assert hw.extra["fit"]["cases"] == 12 and "eplb calibrate" in hw.source


def test_measurements_round_trip_and_too_few_cases(tmp_path):
    truth = Hardware("t", {"fp32": 1e10}, 1e10, 1e9, 1e9)
    m = _measurements(truth, C=3)
    m.save(tmp_path / "m.npz")
    back = ShimMeasurements.load(tmp_path / "m.npz")
    assert back.names == m.names and np.array_equal(back.rows_CBLGS, m.rows_CBLGS) and back.hidden == 256
    with pytest.raises(EplbError, match="at least 4 cases"):
        fit_profile(m)
