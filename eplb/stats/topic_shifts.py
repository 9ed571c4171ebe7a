"""When the synthetic generator's topics change and how each window mixes them (numpy only).

Legend: T = time windows, U = topic segments (topic_shifts + 1), L = MoE layers, E = logical experts.

A trace with topic shifts is cut into U segments; segment u starts at a point s_u (in windows,
s_0 = 0) and its topic's share of the traffic grows from 0 to 1 over `topic_ramp` windows
after s_u, taking that share from the segment before it. Window t covers [t, t + 1), so its
tokens are a mix: segment u's share is the mean over the window of

    c_u(x) - c_{u+1}(x),   c_u(x) = clip((x - s_u) / ramp, 0, 1)   (a step at s_u for ramp 0),

which is never negative and sums to 1 over the segments (the c_u telescope). The shapes:
- abrupt: ramp 0 and s_u a whole window: every window holds one topic (the original shifts);
- gradual (`topic_ramp` R > 0): the hot set fades in over R windows, the old one out;
- inside (`topic_inside`): s_u falls at a uniformly drawn point inside its window, so that
  window mixes the old topic (its first part) and the new one;
- recurring (`topic_recur` R >= 2): segment u has topic u mod R: topics take turns
  (A B A B with 2), each with the hot experts it had the first time it came;
- layer-local: a few experts (`topic_experts`) turning hot in a small share of the layers
  (`topic_layers`); that part is the boost's (eplb.stats.synth.shift_topic), not the schedule's.
`SHIFT_SHAPES` names them as settings of eplb.stats.synth.SynthSettings.
"""

from __future__ import annotations

import numpy as np

from eplb.core.trace import Trace
from eplb.errors import EplbError

SHIFT_SHAPES: dict[str, dict] = {
    "abrupt": {},
    "gradual": {"topic_ramp": 4},
    "recurring": {"topic_recur": 2},
    "inside": {"topic_inside": True},
    "local": {"topic_layers": 0.1, "topic_experts": 3, "topic_hot": (0.1, 0.2)},
}
"""Shapes of topic shift, as the SynthSettings they change (`eplb synth --topic-shape NAME`)."""


def shift_starts(num_windows: int, shifts: int, rng: np.random.Generator) -> np.ndarray:
    """Whole-window starts of the segments after the first, int [<= shifts]: one per segment of
    T / (shifts + 1) windows, jittered by up to a quarter segment (starts that coincide merge)."""
    T, U = num_windows, shifts + 1
    seg = T / U
    at = sorted({min(T - 1, max(1, int(round(u * seg + rng.uniform(-0.25, 0.25) * seg)))) for u in range(1, U)})
    return np.asarray(at, dtype=np.int64)


def _ramp_integral(y: np.ndarray, ramp: float) -> np.ndarray:
    """Integral of clip(z / ramp, 0, 1) over z from -inf to y (ramp 0: a unit step at 0)."""
    if ramp <= 0:
        return np.maximum(y, 0.0)
    return np.where(y <= 0, 0.0, np.where(y < ramp, y * y / (2 * ramp), ramp / 2 + (y - ramp)))


def segment_shares(num_windows: int, starts_U: np.ndarray, ramp: float) -> np.ndarray:
    """Share of each window's tokens that each segment's topic takes, [T, U] (rows sum to 1).

    starts_U: where segments 1..U-1 start, in windows (fractional inside a window), ascending."""
    T = num_windows
    # c_u averaged over window t is (I(t + 1 - s_u) - I(t - s_u)); segment 0 has c_0 = 1.
    edge_T1 = np.arange(T + 1, dtype=np.float64)[:, None]
    c_TU = np.ones((T, len(starts_U) + 1))
    if len(starts_U):
        area = _ramp_integral(edge_T1 - np.asarray(starts_U, dtype=np.float64)[None, :], ramp)
        c_TU[:, 1:] = area[1:] - area[:-1]
    share_TU = c_TU.copy()
    share_TU[:, :-1] -= c_TU[:, 1:]
    return np.clip(share_TU, 0.0, 1.0)


def split_tokens(num_tokens: int, share_U: np.ndarray) -> np.ndarray:
    """Tokens of a window per segment, int [U], summing to num_tokens (largest remainders)."""
    exact = num_tokens * share_U / share_U.sum()
    out = np.floor(exact).astype(np.int64)
    rest = num_tokens - int(out.sum())
    if rest:
        out[np.argsort(-(exact - out), kind="stable")[:rest]] += 1
    return out


def segment_topics(num_segments: int, recur: int) -> np.ndarray:
    """Topic of each segment, int [U]: each its own (recur 0), else segment u mod recur."""
    u = np.arange(num_segments)
    return u if recur == 0 else u % recur


def topic_shift_stats(trace: Trace) -> list[dict]:
    """Measured share of each boosted expert in the windows before and after its shift.

    For every boost recorded in meta "topic_shifts" (eplb synth traces with topic shifts):
    {window, layer, expert, before, after}: the expert's share of the layer's tokens (count /
    tokens of the window) over the windows of the topic just before and of the topic starting
    at the shift; where windows mix topics (meta "topic_shares"), over the windows that hold
    one topic alone, or the most of it when none does."""
    shifts, topics = trace.meta.get("topic_shifts"), trace.meta.get("topics")
    if not shifts or not topics:
        raise EplbError("trace meta has no topic shifts (make one with eplb synth --topic-shifts N)")
    topic_T = np.asarray(topics)
    share_TU = np.asarray(trace.meta.get("topic_shares", np.eye(topic_T.max() + 1)[topic_T]))
    tokens = trace.meta["tokens_per_window"]
    out = []
    for d in shifts:
        u = _segment_at(share_TU, d["window"])
        c_T = trace.counts_TLE[:, d["layer"], d["expert"]]
        out.append({**{k: d[k] for k in ("window", "layer", "expert")},
                    "before": _mean_share(c_T, share_TU[:, u - 1], tokens),
                    "after": _mean_share(c_T, share_TU[:, u], tokens)})
    return out


def _mean_share(c_T: np.ndarray, share_T: np.ndarray, tokens: int) -> float:
    """Mean share of the tokens c_T [T] over the windows a segment holds alone (share_T [T] of
    its tokens 1), or over those that hold the most of it when none does."""
    pure_T = share_T >= 1.0 - 1e-9
    rows_T = pure_T if pure_T.any() else share_T == share_T.max()
    return float(c_T[rows_T].mean() / tokens)


def _segment_at(share_TU: np.ndarray, window: int) -> int:
    """The newest segment serving in `window` (the one a boost recorded there started)."""
    return int(np.flatnonzero(share_TU[window] > 0)[-1])
