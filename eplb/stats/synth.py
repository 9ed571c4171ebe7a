"""Seeded synthetic router traffic shaped like DeepSeek-V3 (numpy only, deterministic).

Legend: T = time windows, L = MoE layers, E = logical experts, Q = expert groups (G stays GPUs),
N = tokens per window, K = experts per token (top-k).

Model of the traffic, per MoE layer l and window t:
- every expert has a routing logit  b[t, l, e] = sigma_l * (a * z[l, e] + b * phase[ph(t), l, e]
  + c * drift[t, l, e]) + group[l, g(e)] + trend_l * h(e), with a^2 + b^2 + c^2 = 1 so the
  spread is sigma_l whatever the mix. `z` is the experts' popularity, a standardised mix of
  Gumbel and normal draws (`tail`): right-skewed, a few very hot experts and few near-dead
  ones, as in the real DeepSeek-V3 counts; `phase` is specific to prefill or decode; `drift` is an AR(1) random
  walk over windows (gradual drift); `group` makes whole expert groups hotter or colder.
- `h(e)` is one smooth, decreasing profile along the expert id, 1 - sqrt((e + 1/2) / E),
  standardised, shared by every layer, with a per-layer strength trend_l (lognormal around
  `id_trend`). It is the coarse structure of the real counts: in SGLang's DeepSeek-V3 files the
  load averaged over layers falls steadily from expert 0 to expert 255 (block of experts 0-7 at
  1.6-2.7x the mean, 248-255 at 0.6-0.75x; within each group too), so neighbouring experts,
  groups and hence contiguous ranks are hot together, while after removing that profile
  neighbouring experts are uncorrelated (lag-1 correlation ~0). Independent per-group offsets
  alone cannot give it: they make busiest/mean at 8 GPUs (one group each) high but leave 4 GPUs
  (two adjacent groups each) near 1.2, where real traffic sits at 1.3-1.6.
- windows come in runs of one phase (prefill or decode) whose lengths are drawn between
  `phase_run` bounds: a phase switch changes the `phase` term at once.
- each of the N tokens of a window is routed the way DeepSeek-V3's router does it: its score
  for expert e is the logit plus independent Gumbel noise (so experts are drawn in proportion
  to softmax(logits) without replacement); the group score is the sum of the group's two best
  scores; the token keeps the `topk_groups` best groups and takes the K best experts in them.

The default settings were calibrated on SGLang's published DeepSeek-V3 expert statistics (see
traces/README.md for the measured numbers); `eplb.stats.calibration` measures a trace the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from eplb.core.files import MAX_INPUT_ENV, format_size, max_input_bytes
from eplb.core.trace import Trace
from eplb.errors import EplbError
from eplb.stats.topic_shifts import (  # noqa: F401  (topic_shift_stats, SHIFT_SHAPES: importable from here too)
    SHIFT_SHAPES,
    segment_shares,
    segment_topics,
    shift_starts,
    split_tokens,
    topic_shift_stats,
)

PHASES = ("prefill", "decode")
MAX_LOGIT_SPREAD = 100
"""Largest skew, group_skew and id_trend (logit units): routed in float32, larger ones overflow."""
MAX_LOG_SPREAD = 10
"""Largest skew_spread and id_trend_spread (exponents of a normal draw)."""


@dataclass(frozen=True)
class SynthSettings:
    """Settings of the synthetic generator; the defaults give DeepSeek-V3-shaped traffic."""

    num_windows: int = 32
    """T: time windows."""
    tokens_per_window: int = 2048
    """N: tokens routed in each window (each counts K times)."""
    num_hidden_layers: int = 61
    """Hidden layers of the model (dense and MoE)."""
    first_moe_layer: int = 3
    """Hidden-layer index of the first MoE layer; layers before it are dense."""
    num_experts: int = 256
    """E: routed (logical) experts per MoE layer."""
    top_k: int = 8
    """K: experts each token is routed to."""
    num_expert_groups: int = 8
    """Expert groups for group-limited routing (E must be divisible by it)."""
    topk_groups: int = 4
    """Groups each token may use (DeepSeek-V3: 4 of 8)."""
    skew: float = 0.67
    """Median over layers of sigma_l, the spread of the expert logits (the main skew knob)."""
    skew_spread: float = 0.05
    """Layer-to-layer spread of sigma_l (std of its log), so some layers are much hotter."""
    tail: float = 0.3
    """Mix of the popularity distribution: 1 = Gumbel (long right tail), 0 = normal."""
    group_skew: float = 0.1
    """Std of a per-group logit offset (makes whole expert groups hotter or colder)."""
    id_trend: float = 0.23
    """Median over layers of the strength (logit std) of a smooth trend along expert ids: low ids hotter."""
    id_trend_spread: float = 0.3
    """Layer-to-layer spread of the id trend's strength (std of its log)."""
    phase_share: float = 0.18
    """Share b^2 of the logit variance that is specific to the phase (prefill or decode)."""
    drift_share: float = 0.05
    """Share c^2 of the logit variance that drifts from window to window."""
    drift_memory: float = 0.9
    """AR(1) coefficient of the drift term between consecutive windows (1 = frozen)."""
    phase_run: tuple[int, int] = (3, 8)
    """Shortest and longest run of consecutive windows in one phase."""
    keep_tokens: int = 0
    """Per-token expert choices to keep per window (0 = counts only); stored as topk_ids."""
    seed: int = 0
    """Seed of numpy's default_rng: same settings and seed give the same trace."""
    topic_shifts: int = 0
    """Abrupt topic shifts over the trace (0 = none). At each, in a share `topic_layers` of the
    layers, one expert that took under `topic_cold` of the layer's tokens before the shift
    takes a share drawn from `topic_hot` after it, until the next shift (see `topic_offsets`)."""
    topic_layers: float = 0.3
    """Share of the MoE layers in which a topic shift makes a cold expert hot (at least one layer)."""
    topic_hot: tuple[float, float] = (0.2, 0.3)
    """Range of the share of a layer's tokens (routed to it as one of their K experts) that the
    newly hot expert takes after a shift."""
    topic_cold: float = 0.003
    """The newly hot expert is drawn among the experts that took less than this share of the
    layer's tokens before the shift (the coldest expert when none is that cold)."""
    topic_ramp: int = 0
    """Windows over which a new topic's share of the tokens grows from none to all, the old
    topic's falling as it grows (gradual drift; 0 = abrupt). See eplb.stats.topic_shifts."""
    topic_inside: bool = False
    """Shifts fall at a uniformly drawn point inside a window, which then mixes the old topic's
    tokens and the new one's (else at a window's start)."""
    topic_recur: int = 0
    """Topics that take turns: 0 = each shift brings a new topic; R >= 2 = segment u has topic
    u mod R (A B A B with 2), with the hot experts it had the first time."""
    topic_experts: int = 1
    """Experts a topic turns hot in each layer it touches, each to a share drawn from
    `topic_hot` (a few, with a small `topic_layers`: hot sets local to some layers)."""

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise EplbError(msg)

        for f in fields(self):
            v = getattr(self, f.name)
            # Types first: 2.5 windows or a seed of 1.5 would be used as given, "8" fail in a comparison.
            if f.type == "int":
                need(isinstance(v, (int, np.integer)) and not isinstance(v, bool),
                     f"{f.name} must be a whole number, got {v!r}")
            elif f.type == "float":
                need(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool),
                     f"{f.name} must be a number, got {v!r}")
            # NaN passes no comparison and inf passes ">= 0": say which setting is not a number.
            need(not isinstance(v, float) or math.isfinite(v), f"{f.name} must be a finite number, got {v}")
        need(len(self.phase_run) == 2 and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                                              for x in self.phase_run),
             f"phase_run must be two whole numbers (shortest, longest), got {self.phase_run!r}")
        need(self.num_windows >= 1, f"num_windows must be >= 1, got {self.num_windows}")
        need(self.tokens_per_window >= 1, f"tokens_per_window must be >= 1, got {self.tokens_per_window}")
        need(0 <= self.first_moe_layer < self.num_hidden_layers,
             f"first_moe_layer ({self.first_moe_layer}) must be in 0..num_hidden_layers-1 "
             f"({self.num_hidden_layers - 1})")
        need(self.num_expert_groups >= 1 and self.num_experts % self.num_expert_groups == 0,
             f"num_experts ({self.num_experts}) must be divisible by num_expert_groups ({self.num_expert_groups})")
        per_group = self.num_experts // self.num_expert_groups
        need(1 <= self.topk_groups <= self.num_expert_groups,
             f"topk_groups ({self.topk_groups}) must be in 1..num_expert_groups ({self.num_expert_groups})")
        need(1 <= self.top_k <= self.topk_groups * per_group,
             f"top_k ({self.top_k}) must be in 1..{self.topk_groups * per_group} (experts in the allowed groups)")
        need(per_group >= 2, f"each expert group needs >= 2 experts for the group score, got {per_group}")
        need(0 <= self.tail <= 1, f"tail must be in [0, 1], got {self.tail}")
        need(self.skew >= 0 and self.skew_spread >= 0 and self.group_skew >= 0,
             f"skew ({self.skew}), skew_spread ({self.skew_spread}) and group_skew ({self.group_skew}) must be >= 0")
        need(self.id_trend >= 0 and self.id_trend_spread >= 0,
             f"id_trend ({self.id_trend}) and id_trend_spread ({self.id_trend_spread}) must be >= 0")
        # Logits are routed in float32: past these the largest logit overflows (1e300 wrote a trace
        # of NaN draws), and well before them every token already picks the same experts.
        for name in ("skew", "group_skew", "id_trend"):
            need(getattr(self, name) <= MAX_LOGIT_SPREAD,
                 f"{name} must be <= {MAX_LOGIT_SPREAD} (a spread of expert logits; real traces are near 0.3-1.5, and "
                 f"from about 10 on every token picks the same experts), got {getattr(self, name):g}")
        for name in ("skew_spread", "id_trend_spread"):
            need(getattr(self, name) <= MAX_LOG_SPREAD,
                 f"{name} must be <= {MAX_LOG_SPREAD} (the spread of a log-normal factor across layers), got "
                 f"{getattr(self, name):g}")
        need(self.phase_share >= 0 and self.drift_share >= 0 and self.phase_share + self.drift_share <= 1,
             f"phase_share ({self.phase_share}) and drift_share ({self.drift_share}) must be >= 0 and sum to <= 1")
        need(0 <= self.drift_memory <= 1, f"drift_memory must be in [0, 1], got {self.drift_memory}")
        lo, hi = self.phase_run
        need(1 <= lo <= hi,
             f"phase_run must be (shortest, longest) with 1 <= shortest <= longest, got {self.phase_run}")
        need(0 <= self.keep_tokens <= self.tokens_per_window,
             f"keep_tokens ({self.keep_tokens}) must be in 0..tokens_per_window ({self.tokens_per_window})")
        need(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        need(0 <= self.topic_shifts < self.num_windows,
             f"topic_shifts ({self.topic_shifts}) must be in 0..num_windows-1 ({self.num_windows - 1})")
        need(0 < self.topic_layers <= 1, f"topic_layers must be in (0, 1], got {self.topic_layers}")
        need(len(self.topic_hot) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                              and 0 < x < 1 for x in self.topic_hot)
             and self.topic_hot[0] <= self.topic_hot[1],
             f"topic_hot must be (lowest, highest) shares in (0, 1), got {self.topic_hot!r}")
        need(0 < self.topic_cold < self.topic_hot[0],
             f"topic_cold ({self.topic_cold}) must be in (0, topic_hot[0] = {self.topic_hot[0]})")
        need(isinstance(self.topic_inside, (bool, np.bool_)),
             f"topic_inside must be true or false, got {self.topic_inside!r}")
        need(0 <= self.topic_ramp < self.num_windows,
             f"topic_ramp ({self.topic_ramp}) must be 0 (abrupt) to num_windows-1 ({self.num_windows - 1}) windows")
        need(self.topic_recur == 0 or 2 <= self.topic_recur <= self.topic_shifts + 1,
             f"topic_recur ({self.topic_recur}) must be 0 (every topic new) or 2..topic_shifts+1 "
             f"({self.topic_shifts + 1}): the topics that take turns")
        need(1 <= self.topic_experts <= self.num_experts // 2,
             f"topic_experts ({self.topic_experts}) must be in 1..num_experts/2 ({self.num_experts // 2})")
        need(self.topic_experts * self.topic_hot[1] <= self.top_k,
             f"topic_experts x topic_hot[1] ({self.topic_experts} x {self.topic_hot[1]}) must be <= top_k "
             f"({self.top_k}): the hot experts' shares cannot take more than every token's choices")
        # Sizes typed on a command line are bounded like files: the trace must fit the input
        # limit it would be read back under, and so must routing one window (float32 [N, E] x ~3).
        limit = max_input_bytes()
        L, T, N, E = self.num_moe_layers, self.num_windows, self.tokens_per_window, self.num_experts
        trace_bytes = 8 * T * L * E + 2 * T * self.keep_tokens * L * self.top_k
        need(trace_bytes <= limit, f"a trace of {T} windows x {L} layers x {E} experts would take "
                                   f"{format_size(trace_bytes)}, more than the input limit of {format_size(limit)} "
                                   f"({MAX_INPUT_ENV}) it is read back under: fewer windows, or raise the limit")
        route_bytes = 12 * N * E
        need(route_bytes <= limit, f"routing {N} tokens per window over {E} experts would take "
                                   f"{format_size(route_bytes)}, more than the input limit of {format_size(limit)} "
                                   f"({MAX_INPUT_ENV}): fewer tokens per window, or raise the limit")

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_moe_layer


def _std(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Standardise along an axis (mean 0, std 1)."""
    x = x - x.mean(axis=axis, keepdims=True)
    return x / x.std(axis=axis, keepdims=True)


def route_tokens(logit_E: np.ndarray, num_tokens: int, s: SynthSettings, rng: np.random.Generator) -> np.ndarray:
    """Group-limited top-k routing of num_tokens tokens, returns expert ids int64 [N, K]."""
    E, Q = s.num_experts, s.num_expert_groups
    per_group = E // Q
    # Gumbel noise on the logits: top-k of (logit + Gumbel) samples from softmax without
    # replacement. -log of a standard exponential is Gumbel; numpy draws those fast (ziggurat).
    x_NE = rng.standard_exponential((num_tokens, E), dtype=np.float32)
    score_NE = logit_E.astype(np.float32)[None, :] - np.log(np.maximum(x_NE, np.float32(1e-30)))
    score_NQX = score_NE.reshape(num_tokens, Q, per_group)
    # Group score = sum of the group's two best expert scores (DeepSeek-V3's noaux_tc router).
    group_NQ = np.partition(score_NQX, per_group - 2, axis=2)[:, :, -2:].sum(axis=2)
    # Keep the best topk_groups groups (in any order), then the top-k experts inside them;
    # gathering the kept groups first halves the work of the final selection.
    keep_NH = np.argpartition(-group_NQ, s.topk_groups - 1, axis=1)[:, : s.topk_groups]
    kept_NHX = np.take_along_axis(score_NQX, keep_NH[:, :, None], axis=1)
    flat_NM = kept_NHX.reshape(num_tokens, s.topk_groups * per_group)
    pick_NK = np.argpartition(-flat_NM, s.top_k - 1, axis=1)[:, : s.top_k]
    group_NK = np.take_along_axis(keep_NH, pick_NK // per_group, axis=1)
    return (group_NK * per_group + pick_NK % per_group).astype(np.int64)


def phase_schedule(s: SynthSettings, rng: np.random.Generator) -> np.ndarray:
    """Phase index (0 = prefill, 1 = decode) of each window, [T]: alternating runs."""
    out = np.empty(s.num_windows, dtype=np.int64)
    t, ph = 0, int(rng.integers(2))
    lo, hi = s.phase_run
    while t < s.num_windows:
        n = int(rng.integers(lo, hi + 1))
        out[t: t + n] = ph
        t, ph = t + n, 1 - ph
    return out


def id_trend(s: SynthSettings, rng: np.random.Generator) -> np.ndarray:
    """Smooth logit trend along expert ids, [L, E]: highest at expert 0, one shape, per-layer strength."""
    x_E = (np.arange(s.num_experts) + 0.5) / s.num_experts
    shape_E = _std(1.0 - np.sqrt(x_E))
    strength_L = s.id_trend * np.exp(s.id_trend_spread * rng.standard_normal(s.num_moe_layers))
    return strength_L[:, None] * shape_E[None, :]


_CALIBRATION_TOKENS = 2048
"""Tokens routed to find the boost that gives a newly hot expert its share."""


def topic_schedule(s: SynthSettings, rng: np.random.Generator) -> np.ndarray:
    """Topic segment of each window, [T]: one shift per segment of T / (topic_shifts + 1) windows,
    jittered by up to a quarter segment (shifts that would coincide merge)."""
    return np.searchsorted(shift_starts(s.num_windows, s.topic_shifts, rng), np.arange(s.num_windows), side="right")


def shift_topic(s: SynthSettings, logit_LE: np.ndarray, before_LE: np.ndarray, rng: np.random.Generator,
                window: int) -> tuple[np.ndarray, list[dict]]:
    """Logit offsets [L, E] of a new topic starting at `window`, and what each boost did.

    Each layer is picked with probability `topic_layers` (at least one). In a picked layer
    `topic_experts` experts whose share of the tokens in `before_LE` (the counts of the previous
    topic's windows) is under `topic_cold` (else the coldest) get logit boosts, one after
    another, each found by bisection on a fixed token sample routed with `logit_LE` (this
    window's logits, without the old topic's boosts) and the boosts found before it, that
    gives the expert a share of the tokens drawn from `topic_hot`.
    """
    L, E = logit_LE.shape
    offset_LE = np.zeros((L, E))
    tokens = max(before_LE[0].sum() / s.top_k, 1.0)
    layers = np.flatnonzero(rng.random(L) < s.topic_layers)
    if layers.size == 0:
        layers = rng.integers(L, size=1)
    boosts = []
    for l in layers:
        share_E = before_LE[l] / tokens
        taken: list[int] = []
        for _ in range(s.topic_experts):
            free_E = np.ones(E, dtype=bool)
            free_E[taken] = False
            cold = np.flatnonzero((share_E < s.topic_cold) & free_E)
            e = int(rng.choice(cold)) if cold.size else int(np.flatnonzero(free_E)[np.argmin(share_E[free_E])])
            target = float(rng.uniform(*s.topic_hot))
            seed = int(rng.integers(2**63))
            lo, hi = 0.0, 40.0
            for _ in range(20):  # bisection: the share grows with the boost
                mid = 0.5 * (lo + hi)
                boosted = logit_LE[l] + offset_LE[l]
                boosted[e] += mid
                top_NK = route_tokens(boosted, _CALIBRATION_TOKENS, s, np.random.default_rng(seed))
                lo, hi = (mid, hi) if (top_NK == e).sum() < target * _CALIBRATION_TOKENS else (lo, mid)
            offset_LE[l, e] = 0.5 * (lo + hi)
            taken.append(e)
            boosts.append({"window": int(window), "layer": int(l), "expert": e,
                           "share_before": float(share_E[e]), "target": target})
    return offset_LE, boosts


class _Topics:
    """The topic segments of one trace: which topic each window's tokens follow, and each topic's
    logit offsets, [L, E], made the first time it serves (eplb.stats.topic_shifts)."""

    def __init__(self, s: SynthSettings):
        # Their own generators: settings without shifts leave every other draw unchanged, and
        # abrupt shifts the draws they made before the other shapes existed.
        self.s, self.rng = s, np.random.default_rng([s.seed, 0x70])
        starts = shift_starts(s.num_windows, s.topic_shifts, self.rng).astype(np.float64)
        if s.topic_inside:
            starts = starts + np.random.default_rng([s.seed, 0x71]).uniform(0.0, 1.0, len(starts))
        self.share_TU = segment_shares(s.num_windows, starts, s.topic_ramp)
        self.topic_U = segment_topics(len(starts) + 1, s.topic_recur)
        self.offsets = {0: np.zeros((s.num_moe_layers, s.num_experts))}   # topic 0: the base traffic
        self.boosts: list[dict] = []
        self._last = 0               # the newest segment that has served
        self._last_start = 0         # the window it began in

    @property
    def mixed(self) -> bool:
        """Does some window mix topics (a ramp, or a shift inside a window)?"""
        return bool((self.share_TU.max(axis=1) < 1.0).any())

    def window_logits(self, t: int, logit_LE: np.ndarray, counts_TLE: np.ndarray) -> list[tuple[float, np.ndarray]]:
        """(share of window t's tokens, logits [L, E]) for each topic serving in window t."""
        out = []
        for u in np.flatnonzero(self.share_TU[t] > 0):
            topic = int(self.topic_U[u])
            if u > self._last:
                if topic not in self.offsets:
                    before_LE = counts_TLE[self._last_start:t].sum(axis=0) if t > self._last_start \
                        else counts_TLE[max(t - 1, 0)]
                    self.offsets[topic], boosts = shift_topic(self.s, logit_LE, before_LE, self.rng, t)
                    self.boosts += boosts
                self._last, self._last_start = int(u), t
            out.append((float(self.share_TU[t, u]), logit_LE + self.offsets[topic]))
        return out

    def meta(self) -> dict:
        out = {"topics": self.share_TU.argmax(axis=1).tolist(), "topic_shifts": self.boosts}
        if self.mixed:
            out["topic_shares"] = np.round(self.share_TU, 6).tolist()
        if self.s.topic_recur:
            out["topic_of_segment"] = self.topic_U.tolist()
        return out


def generate(settings: SynthSettings | None = None, progress=None) -> Trace:
    """A synthetic trace [T, L, E] for the given settings (deterministic in settings.seed)."""
    s = settings or SynthSettings()
    rng = np.random.default_rng(s.seed)
    L, E, Q, T = s.num_moe_layers, s.num_experts, s.num_expert_groups, s.num_windows

    # Step 1: per-layer model of expert popularity (fixed for the whole trace).
    sigma_L = s.skew * np.exp(s.skew_spread * rng.standard_normal(L))
    z_LE = _std(s.tail * _std(rng.gumbel(size=(L, E))) + (1.0 - s.tail) * rng.standard_normal((L, E)))
    phase_PLE = _std(rng.standard_normal((2, L, E)))
    group_LE = np.repeat(s.group_skew * rng.standard_normal((L, Q)), E // Q, axis=1)
    a = np.sqrt(1.0 - s.phase_share - s.drift_share)
    b, c = np.sqrt(s.phase_share), np.sqrt(s.drift_share)
    phase_T = phase_schedule(s, rng)
    trend_LE = id_trend(s, rng)
    topics = _Topics(s) if s.topic_shifts else None

    # Step 2: windows: drift the logits, then route every token.
    counts_TLE = np.zeros((T, L, E), dtype=np.int64)
    keep = s.keep_tokens
    topk_NLK = np.zeros((T * keep, L, s.top_k), dtype=np.int16) if keep else None
    drift_LE = rng.standard_normal((L, E))
    rho = s.drift_memory
    for t in range(T):
        if t:
            drift_LE = rho * drift_LE + np.sqrt(1.0 - rho * rho) * rng.standard_normal((L, E))
        mix_LE = a * z_LE + b * phase_PLE[phase_T[t]] + c * drift_LE
        logit_LE = sigma_L[:, None] * mix_LE + group_LE + trend_LE
        # A window that mixes topics routes each topic's share of its tokens, the older first.
        parts = [(1.0, logit_LE)] if topics is None else topics.window_logits(t, logit_LE, counts_TLE)
        n_U = split_tokens(s.tokens_per_window, np.array([w for w, _ in parts]))
        for l in range(L):
            top_NK = np.concatenate([route_tokens(lg[l], n, s, rng) for n, (_, lg) in zip(n_U, parts) if n])
            counts_TLE[t, l] = np.bincount(top_NK.ravel(), minlength=E)
            if keep:
                topk_NLK[t * keep:(t + 1) * keep, l] = top_NK[:keep]
        if progress is not None:
            progress(t + 1, T)

    deepseek = (s.num_hidden_layers, s.first_moe_layer, E, s.top_k, Q, s.topk_groups) == (61, 3, 256, 8, 8, 4)
    meta = {
        # Another shape is not DeepSeek-V3's, whatever the generator was calibrated on.
        "model": "DeepSeek-V3 (synthetic shape)" if deepseek else
                 f"synthetic MoE ({E} experts, top-{s.top_k}, {Q} expert group{'s' if Q > 1 else ''})",
        "num_hidden_layers": s.num_hidden_layers,
        "num_experts": E,
        "top_k": s.top_k,
        "num_expert_groups": Q,
        "topk_groups": s.topk_groups,
        "tokens_per_window": s.tokens_per_window,
        "source": (f"eplb synth (eplb.stats.synth) seed={s.seed}, calibrated on SGLang DeepSeek-V3 expert statistics "
                   f"(sglang issue #6017: per-layer hottest/mean, Gini, contiguous busiest/mean GPU at 4-32 GPUs, "
                   f"prefill-decode correlation)"),
        "synthetic": True,
        "phases": [PHASES[p] for p in phase_T],
        "synth_settings": json.loads(json.dumps(_recorded_settings(s))),
    }
    if topics is not None:
        meta.update(topics.meta())
    layer_ids = np.arange(s.first_moe_layer, s.num_hidden_layers)
    token_window = np.repeat(np.arange(T, dtype=np.int32), keep) if keep else None
    return Trace(counts_TLE, layer_ids, meta, topk_NLK, token_window)


def _recorded_settings(s: SynthSettings) -> dict:
    """Settings for the trace's meta; without topic shifts the topic fields are left out, and
    the shapes' fields where they keep their defaults, so a trace made before they existed
    (traces/deepseek.npz, the abrupt topic traces) is remade byte for byte."""
    d = asdict(s)
    if not s.topic_shifts:
        for f in ("topic_shifts", "topic_layers", "topic_hot", "topic_cold"):
            d.pop(f)
    for f in SHAPE_FIELDS:
        if d[f] == SynthSettings.__dataclass_fields__[f].default:
            d.pop(f)
    return d


SHAPE_FIELDS = ("topic_ramp", "topic_inside", "topic_recur", "topic_experts")
"""The settings of a topic shift's shape (eplb.stats.topic_shifts), beyond the abrupt shifts'."""


def shaped_settings(shape: str, **settings) -> SynthSettings:
    """SynthSettings for a named shape of topic shift (SHIFT_SHAPES), `settings` overriding it
    (topic_shifts: 6 unless given)."""
    if shape not in SHIFT_SHAPES:
        raise EplbError(f"unknown topic shape {shape!r}: choose one of {', '.join(SHIFT_SHAPES)}")
    return SynthSettings(**{"topic_shifts": 6, **SHIFT_SHAPES[shape], **settings})
