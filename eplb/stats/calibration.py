"""How skewed a load is, in the figures the synthetic traffic (`eplb.stats.synth`) is calibrated on.

Legend: L = MoE layers, E = logical experts.

SGLang's published DeepSeek-V3 expert statistics, measured with these functions, set the
generator's defaults (traces/README.md has the numbers); `eplb synth --compare` prints them
for a generated trace beside real ones.
"""

from __future__ import annotations

import numpy as np

from eplb import stats
from eplb.core.placement import contiguous_map, gpu_loads
from eplb.core.topology import Topology
from eplb.core.trace import Trace
from eplb.errors import EplbError
from eplb.stats.synth import _std

CONTIGUOUS_GPUS = (4, 8, 16, 32)
"""GPU counts at which calibration_stats measures contiguous placement (coarse structure)."""


def contiguous_imbalance(load_LE: np.ndarray, num_gpus: int) -> float:
    """Median over layers of busiest/mean GPU when expert e sits on GPU e // (E / num_gpus)."""
    load = np.asarray(load_LE, dtype=np.float64)
    L, E = load.shape
    if num_gpus < 1 or E % num_gpus:
        raise EplbError(f"contiguous placement needs num_gpus dividing num_experts ({E}), got {num_gpus}")
    phy2log_LP = contiguous_map(E, Topology(num_gpus, E // num_gpus), L)
    return float(np.median(stats.imbalance(gpu_loads(phy2log_LP, load, num_gpus, 1.0))))


def calibration_stats(load_LE: np.ndarray) -> dict:
    """The skew figures the generator is calibrated on, for one load [L, E].

    `contig_G<n>`: contiguous busiest/mean GPU at n GPUs (only for n dividing E).
    """
    hot_L, gini_L = stats.hot_ratio(load_LE), stats.gini(load_LE)
    E = np.shape(load_LE)[-1]
    return {
        "hot_median": float(np.median(hot_L)), "hot_min": float(hot_L.min()), "hot_max": float(hot_L.max()),
        "gini_median": float(np.median(gini_L)), "gini_min": float(gini_L.min()), "gini_max": float(gini_L.max()),
        **{f"contig_G{g}": contiguous_imbalance(load_LE, g) for g in CONTIGUOUS_GPUS if E % g == 0},
    }


def layer_correlation(a_LE: np.ndarray, b_LE: np.ndarray) -> float:
    """Median over layers of the Pearson correlation of two loads [L, E]."""
    a = _std(np.asarray(a_LE, dtype=np.float64))
    b = _std(np.asarray(b_LE, dtype=np.float64))
    return float(np.median((a * b).mean(axis=1)))


def phase_correlation(trace: Trace) -> float:
    """Median over layers of corr(prefill load, decode load) of a trace with meta 'phases'."""
    phases = trace.meta.get("phases")
    if not phases or len(phases) != trace.num_windows:
        raise EplbError("trace meta has no per-window 'phases' list (only eplb.stats.synth traces carry one)")
    ph = np.array(phases)
    if not (np.any(ph == "prefill") and np.any(ph == "decode")):
        raise EplbError("trace has windows of only one phase; cannot correlate prefill with decode")
    c = trace.counts_TLE
    return layer_correlation(c[ph == "prefill"].sum(axis=0), c[ph == "decode"].sum(axis=0))
