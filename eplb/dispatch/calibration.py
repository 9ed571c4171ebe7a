"""Fitting a hardware profile to measurements of the expert-parallel runtime shim.

Legend: C = cases (placement x batch size), B = measured steps, L = MoE layers, G = ranks,
S = slots per rank.

`eplb.runtime.calibrate` runs the shim over a spread of placements and batch sizes and records,
per case, step, layer and rank, the rows each local slot computed, the expert compute time
(CPU time of the rank's thread on CPU, wall time after a sync on CUDA), the all-to-all wall
time and the rows sent and received. Here the profile's constants are fitted to that:
- experts: (per active replica overhead, FLOP/s, memory bandwidth), by non-linear least
  squares (scipy) on each rank's expert time per step, predicted with exactly the cost
  model's roofline (`CostModel.replica_seconds`) on the shim's shapes;
- all-to-all: (latency, link bandwidth), by a straight line through each rank's all-to-all
  time per step against the bytes it moved. The shim sends one row per (token, expert)
  pair (no per-GPU deduplication), so the fit uses its own bytes.
R^2 is reported in-sample and on held-out cases (fit on even-numbered cases, predict the odd).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.core.files import load_npz
from eplb.core.hardware import Hardware
from eplb.core.outputs import atomic_output
from eplb.dispatch.cost import CostModel
from eplb.errors import EplbError
from eplb.stats.capacity import ModelShape


def shim_model(hidden: int, expert_hidden: int, num_logical_experts: int, top_k: int, num_layers: int) -> ModelShape:
    """The shim's experts as a ModelShape (only the expert numbers matter to the cost model)."""
    return ModelShape("runtime shim", num_hidden_layers=num_layers, hidden_size=hidden, vocab_size=1,
                      num_attention_heads=1, num_kv_heads=1, head_dim=1, intermediate_size=0,
                      num_logical_experts=num_logical_experts, moe_intermediate_size=expert_hidden, top_k=top_k)


@dataclass(frozen=True, eq=False)
class ShimMeasurements:
    """What the ranks recorded, over all cases."""

    names: tuple
    """Label of each case ("greedy, 8 tokens/rank"), [C]."""
    tokens_per_rank: np.ndarray
    """Tokens each rank brought per step and layer, [C]."""
    rows_CBLGS: np.ndarray
    """Rows each local slot computed, [C, B, L, G, S]."""
    compute_s_CBLG: np.ndarray
    """Expert compute seconds, [C, B, L, G]."""
    a2a_s_CBLG: np.ndarray
    """All-to-all wall seconds, [C, B, L, G]."""
    sent_CBLG: np.ndarray
    """Rows each rank sent, [C, B, L, G]."""
    received_CBLG: np.ndarray
    """Rows each rank received (and computed), [C, B, L, G]."""
    hidden: int
    expert_hidden: int
    num_logical_experts: int
    top_k: int
    dtype: str = "fp32"
    backend: str = "gloo"

    def save(self, path) -> None:
        arrays = {k: getattr(self, k) for k in ("tokens_per_rank", "rows_CBLGS", "compute_s_CBLG", "a2a_s_CBLG",
                                                 "sent_CBLG", "received_CBLG")}
        arrays["names"] = np.array(self.names)
        arrays["dims"] = np.array([self.hidden, self.expert_hidden, self.num_logical_experts, self.top_k])
        arrays["text"] = np.array([self.dtype, self.backend])
        with atomic_output(path, what="the measurements") as f:  # the parent reads it when the ranks end
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path) -> ShimMeasurements:
        d = load_npz(path, "measurements file")
        D, F, E, K = (int(v) for v in d["dims"])
        return cls(tuple(str(n) for n in d["names"]), d["tokens_per_rank"], d["rows_CBLGS"], d["compute_s_CBLG"],
                   d["a2a_s_CBLG"], d["sent_CBLG"], d["received_CBLG"], D, F, E, K, str(d["text"][0]),
                   str(d["text"][1]))

    def model(self) -> ModelShape:
        return shim_model(self.hidden, self.expert_hidden, self.num_logical_experts, self.top_k,
                          self.rows_CBLGS.shape[2])

    @property
    def row_bytes_moved(self) -> float:
        """Bytes one row moves: its hidden state and slot id there (int64), its output back."""
        b = 4 if self.dtype == "fp32" else 2
        return self.hidden * b * 2 + 8


def r_squared(measured, predicted) -> float:
    y, p = np.asarray(measured, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    ss = ((y - y.mean()) ** 2).sum()
    return float(1.0 - ((y - p) ** 2).sum() / ss) if ss > 0 else float("nan")


def predicted_compute(m: ShimMeasurements, hw: Hardware) -> np.ndarray:
    """The cost model's expert seconds per rank and step (summed over layers), [C, G]."""
    cost = CostModel(m.model(), hw, expert_dtype=m.dtype, dispatch_dtype=m.dtype, combine_dtype=m.dtype)
    return cost.replica_seconds(m.rows_CBLGS).sum(axis=(2, 4)).mean(axis=1)


def measured_compute(m: ShimMeasurements) -> np.ndarray:
    """Measured expert seconds per rank and step (summed over layers), [C, G]."""
    return m.compute_s_CBLG.sum(axis=2).mean(axis=1)


def _hardware(theta: np.ndarray, link: tuple[float, float], dtype: str, name: str) -> Hardware:
    overhead, flops, bandwidth = np.exp(theta)
    latency, link_bw = link
    return Hardware(name, {dtype: float(flops)}, hbm_bytes_per_s=float(bandwidth), nvlink_bytes_per_s=link_bw,
                    internode_bytes_per_s=link_bw, expert_overhead_s=float(overhead), a2a_latency_s=latency)


def _fit_experts(m: ShimMeasurements, cases: np.ndarray, link, name: str) -> np.ndarray:
    from scipy.optimize import least_squares

    y = measured_compute(m)[cases]
    sub = ShimMeasurements(tuple(np.array(m.names)[cases]), m.tokens_per_rank[cases], m.rows_CBLGS[cases],
                           m.compute_s_CBLG[cases], m.a2a_s_CBLG[cases], m.sent_CBLG[cases], m.received_CBLG[cases],
                           m.hidden, m.expert_hidden, m.num_logical_experts, m.top_k, m.dtype, m.backend)
    scale = max(float(y.mean()), 1e-12)

    def residual(theta):
        return (predicted_compute(sub, _hardware(theta, link, m.dtype, name)) - y).ravel() / scale

    # Start: 10 us per replica, 10 GFLOP/s, 10 GB/s; log-parameters keep every figure positive.
    best = None
    for start in ([np.log(1e-5), np.log(1e10), np.log(1e10)], [np.log(1e-4), np.log(3e10), np.log(3e9)]):
        res = least_squares(residual, np.array(start), method="trf", x_scale=1.0)
        if best is None or res.cost < best.cost:
            best = res
    return best.x


def _fit_link(m: ShimMeasurements, cases: np.ndarray) -> tuple[float, float, float]:
    """(latency per phase, bandwidth, R^2) of all-to-all seconds per rank and step."""
    moved = np.maximum(m.sent_CBLG, m.received_CBLG)[cases] * m.row_bytes_moved        # bytes [c, B, L, G]
    x = moved.mean(axis=1).ravel()                                                    # per layer, rank
    y = m.a2a_s_CBLG[cases].mean(axis=1).ravel()
    slope, icept = np.polyfit(x, y, 1) if np.ptp(x) > 0 else (0.0, float(y.mean()))
    slope = max(float(slope), 1e-15)
    icept = max(float(icept), 0.0)
    return icept / 2, 1.0 / slope, r_squared(y, icept + slope * x)  # two phases (dispatch, combine) per layer


def fit_profile(m: ShimMeasurements, name: str = "calibrated") -> tuple[Hardware, dict]:
    """The fitted profile and a report: parameters, R^2 in-sample and on held-out cases."""
    C = m.rows_CBLGS.shape[0]
    if C < 4:
        raise EplbError(f"calibration needs at least 4 cases (placement x batch size) to fit and check, got {C}")
    every = np.arange(C)
    latency, link_bw, r2_link = _fit_link(m, every)
    link = (latency, link_bw)
    train, test = every[::2], every[1::2]
    held = _hardware(_fit_experts(m, train, link, name), link, m.dtype, name)
    theta = _fit_experts(m, every, link, name)
    hw = _hardware(theta, link, m.dtype, name)
    y, p = measured_compute(m), predicted_compute(m, hw)
    p_held = predicted_compute(m, held)
    report = {
        "cases": C, "points": int(y.size), "backend": m.backend,
        "expert_overhead_s": hw.expert_overhead_s, "flops_per_s": hw.flops(m.dtype),
        "memory_bytes_per_s": hw.hbm_bytes_per_s, "a2a_latency_s": hw.a2a_latency_s,
        "link_bytes_per_s": hw.nvlink_bytes_per_s,
        "r2_compute": r_squared(y, p), "r2_compute_held_out": r_squared(y[test], p_held[test]),
        "r2_all_to_all": r2_link,
        "measured_ms_CG": (1e3 * y).round(4).tolist(), "predicted_ms_CG": (1e3 * p).round(4).tolist(),
        "names": list(m.names),
    }
    shim = {"hidden": m.hidden, "expert_hidden": m.expert_hidden, "experts": m.num_logical_experts,
            "top_k": m.top_k, "dtype": m.dtype}
    extra = {"fit": {k: report[k] for k in ("cases", "points", "r2_compute", "r2_compute_held_out", "r2_all_to_all")},
             "shim": shim}
    return Hardware(hw.name, hw.flops_per_s, hw.hbm_bytes_per_s, hw.nvlink_bytes_per_s, hw.internode_bytes_per_s,
                    hw.expert_overhead_s, hw.a2a_latency_s,
                    source=f"eplb calibrate: runtime shim on {m.backend}, {C} cases", extra=extra), report
