"""Simulation: modeled MoE step time of a placement on a trace, batch by batch.

Legend: T = trace windows, L = MoE layers, E = logical experts, G = GPUs, P = slots,
B = tokens in one step's batch, K = experts per token, n = scored batches.

Each window of the trace is the traffic of one step's batch. With `batch_tokens` given, a
window is cut into batches of that many tokens: runs of consecutive tokens when the trace
carries per-token expert choices (`topk_ids_NLK`: real co-activation, exact all-to-all
bytes), else batches drawn from the window's expert frequencies (a multinomial of B x K rows
per layer: every token picks experts independently; the all-to-all bytes are then
expectations under the same assumption, and the report says so). Without `batch_tokens`
each window is one batch as it is. Every batch is scored under a dispatch rule on the plan,
on the contiguous placement (no EPLB) and at perfect balance (`eplb.dispatch.cost.ideal_layer_seconds`).
Windows are summarised by the mean over their batches, then by median and p95 over windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.core.files import MAX_INPUT_ENV, format_size, max_input_bytes
from eplb.core.placement import Placement, contiguous_placement
from eplb.core.trace import Trace
from eplb.dispatch.cost import CostModel, StepCost, assign_pairs, ideal_layer_seconds, slot_rows, step_cost
from eplb.dispatch.rules import RULES, DispatchRule, get_rule
from eplb.dispatch.timed import TimeDispatch
from eplb.errors import EplbError, seed_value, whole_number

DISPATCH_CHOICES = (*RULES, "time")
"""Rules `simulate` (and `eplb simulate --dispatch`) takes: every rule of eplb.dispatch.RULES, and "time"."""


@dataclass(frozen=True, eq=False)
class Batch:
    """One step's routed rows."""

    counts_LE: np.ndarray
    """Rows per expert, float64 [L, E]."""
    tokens: int
    """Tokens in the batch (B)."""
    window: int
    """Trace window it comes from."""
    topk_BLK: np.ndarray | None = None
    """Per-token expert choices [B, L, K] (None: counts only)."""


def check_batches(num_windows: int, batches_per_window: int, num_layers: int, num_experts: int) -> None:
    """Refuse more step batches than the input limit holds (eplb.core.files): each is an [L, E] float64
    of rows, and a count typed by mistake (--batches 99999999) would fill memory for hours."""
    need = 8 * num_windows * batches_per_window * num_layers * num_experts
    limit = max_input_bytes()
    if need > limit:
        raise EplbError(f"{batches_per_window:,} batches per window x {num_windows} window(s) of {num_layers} layers "
                        f"x {num_experts} experts would take {format_size(need)}, more than the input limit of "
                        f"{format_size(limit)} ({MAX_INPUT_ENV}): fewer batches per window (--batches), or raise "
                        f"the limit")


def cut_batches(trace: Trace, top_k: int, batch_tokens: int | None = None, batches_per_window: int = 8,
                seed: int = 0) -> tuple[list[Batch], str]:
    """Batches of each window (see the module docstring) and a line saying how they were made."""
    K = whole_number("top_k", top_k, 1)
    per = whole_number("batches per window", batches_per_window, 1)
    check_batches(trace.num_windows, per, trace.num_layers, trace.num_logical_experts)
    c_TLE = trace.counts_TLE.astype(np.float64)
    has_tokens = trace.topk_ids_NLK is not None
    if has_tokens and trace.topk_ids_NLK.shape[2] != K:
        raise EplbError(f"the trace's tokens pick {trace.topk_ids_NLK.shape[2]} experts each but the model's "
                        f"top-k is {K}: pick the model the trace was recorded from")
    out: list[Batch] = []
    if batch_tokens is None:
        for t in range(trace.num_windows):
            topk = trace.topk_ids_NLK[trace.token_window_N == t].astype(np.int64) if has_tokens else None
            if topk is not None and len(topk):
                # The rows are the tokens' own choices (a window's counts may cover more tokens).
                out.append(Batch(_bincount(topk, trace.num_logical_experts), len(topk), t, topk))
            else:
                out.append(Batch(c_TLE[t], max(int(round(c_TLE[t].sum(axis=1).max() / K)), 1), t))
        how = "each window is one batch" + (" (per-token choices: exact all-to-all bytes)" if has_tokens else
                                            "; all-to-all bytes assume independent expert choices")
        return out, how
    B = whole_number("batch tokens", batch_tokens, 1)
    rng = np.random.default_rng(seed_value("seed", seed))
    if has_tokens:
        for t in range(trace.num_windows):
            ids = trace.topk_ids_NLK[trace.token_window_N == t]
            n = len(ids) // B
            for start in np.linspace(0, len(ids) - B, num=min(n, per)).astype(int) if n else ():
                topk = ids[start:start + B].astype(np.int64)
                out.append(Batch(_bincount(topk, trace.num_logical_experts), B, t, topk))
        if not out:
            raise EplbError(f"no window of the trace holds {B} tokens (the largest has "
                            f"{np.bincount(trace.token_window_N).max()}): give a smaller --batch-tokens")
        return out, f"runs of {B} consecutive tokens of each window (per-token choices: exact all-to-all bytes)"
    for t in range(trace.num_windows):
        total_L1 = c_TLE[t].sum(axis=1, keepdims=True)
        if not total_L1.all():
            raise EplbError(f"window {t} has a layer with no tokens: it has no expert frequencies to draw "
                            f"batches from; drop the window or give per-token traces")
        share_LE = c_TLE[t] / total_L1
        for _ in range(per):
            out.append(Batch(rng.multinomial(B * K, share_LE).astype(np.float64), B, t))
    return out, (f"{per} batches of {B} tokens drawn from each window's expert frequencies (seed {seed}): "
                 f"independent expert choices assumed for counts and all-to-all bytes")


def window_batches(counts_LE: np.ndarray, top_k: int, batch_tokens: int, batches: int, rng: np.random.Generator,
                   window: int = 0, topk_NLK: np.ndarray | None = None) -> list[Batch]:
    """Up to `batches` step batches of `batch_tokens` tokens from one window.

    With the window's per-token choices (topk_NLK [N, L, K]): runs of consecutive tokens, spread
    evenly over the window (the whole window as one batch when it holds fewer tokens). Else
    draws of B x K rows per layer from the window's expert frequencies (independent choices).
    """
    if topk_NLK is not None:
        N = len(topk_NLK)
        B = min(batch_tokens, N)
        starts = np.linspace(0, N - B, num=min(N // B, batches)).astype(int)
        E = counts_LE.shape[1]
        return [Batch(_bincount(topk_NLK[a:a + B].astype(np.int64), E), B, window, topk_NLK[a:a + B].astype(np.int64))
                for a in starts]
    total_L1 = counts_LE.sum(axis=1, keepdims=True)
    share_LE = np.where(total_L1 > 0, counts_LE / np.where(total_L1 > 0, total_L1, 1.0), 1.0 / counts_LE.shape[1])
    return [Batch(rng.multinomial(batch_tokens * top_k, share_LE).astype(np.float64), batch_tokens, window)
            for _ in range(batches)]


def time_window(cost: CostModel, placement: Placement, bound, batches: list[Batch]) -> tuple[np.ndarray, np.ndarray]:
    """Modeled seconds per layer [L] (mean over the batches) of a placement under a bound rule,
    and the shares [L, P] its replicas took of their experts' rows over all the batches."""
    L, P = placement.phy2log_LP.shape
    layer_L = np.zeros(L)
    rows_LP = np.zeros((L, P))
    counts_LE = np.zeros((L, placement.num_logical_experts))
    for b in batches:
        r_LP = slot_rows(placement, b.counts_LE, bound(b.counts_LE))
        pairs = None if b.topk_BLK is None else assign_pairs(placement, b.topk_BLK, r_LP)
        layer_L += step_cost(cost, placement, r_LP, b.tokens, pairs).layer_s_L
        # slot_rows counts a second copy on one GPU with the first: the shares follow the rows.
        rows_LP += r_LP
        counts_LE += b.counts_LE
    count_LP = np.take_along_axis(counts_LE, placement.phy2log_LP, axis=1)
    even_LP = placement.replica_weights()
    shares_LP = np.where(count_LP > 0, rows_LP / np.where(count_LP > 0, count_LP, 1.0), even_LP)
    return layer_L / max(len(batches), 1), shares_LP


def _bincount(topk_BLK: np.ndarray, E: int) -> np.ndarray:
    B, L, K = topk_BLK.shape
    flat = (np.arange(L)[None, :, None] * E + topk_BLK).ravel()
    return np.bincount(flat, minlength=L * E).reshape(L, E).astype(np.float64)


def get_dispatch(rule: str, cost: CostModel) -> DispatchRule:
    """A DispatchRule by name: eplb.dispatch's rules, or "time" (built with `cost`)."""
    if rule == "time":
        return TimeDispatch(cost)
    if rule not in RULES:
        raise EplbError(f"unknown dispatch rule {rule!r}: choose one of {', '.join(sorted({*RULES, 'time'}))}")
    return get_rule(rule)


def score_batch(cost: CostModel, placement: Placement, bound, batch: Batch) -> StepCost:
    """Modeled time of one batch on one placement under a bound dispatch rule."""
    rows_LP = slot_rows(placement, batch.counts_LE, bound(batch.counts_LE))
    pairs = None if batch.topk_BLK is None else assign_pairs(placement, batch.topk_BLK, rows_LP)
    return step_cost(cost, placement, rows_LP, batch.tokens, pairs)


@dataclass(frozen=True, eq=False)
class SimulationReport:
    """Modeled step times of a plan, the contiguous placement and perfect balance, per batch."""

    rule: str
    """Dispatch rule the plan was scored under."""
    how: str
    """How batches were made (and the independence assumption, when made)."""
    batch_tokens_n: np.ndarray
    """Tokens of each scored batch, [n]."""
    window_n: np.ndarray
    """Trace window of each batch, [n]."""
    plan_s_n: np.ndarray
    """MoE step seconds of the plan, [n]."""
    contiguous_s_n: np.ndarray
    """Same for the contiguous placement, [n]."""
    ideal_s_n: np.ndarray
    """Same at perfect balance, [n]."""
    plan_layer_s_nL: np.ndarray
    """Per-layer seconds of the plan, [n, L]."""
    contiguous_layer_s_nL: np.ndarray
    ideal_layer_s_nL: np.ndarray
    straggler_time_n: np.ndarray
    """Busiest / mean GPU expert time (summed over layers) of the plan, [n]."""
    straggler_tokens_n: np.ndarray
    """Busiest / mean GPU rows of the plan, [n]."""
    contiguous_straggler_time_n: np.ndarray
    busiest_compute_s_n: np.ndarray
    """Sum over layers of the plan's busiest GPU expert time, [n]."""
    contiguous_busiest_compute_s_n: np.ndarray
    intra_bytes_per_token_n: np.ndarray
    """Plan's NVLink bytes per token (dispatch + combine, all layers), [n]."""
    inter_bytes_per_token_n: np.ndarray
    contiguous_intra_bytes_per_token_n: np.ndarray
    contiguous_inter_bytes_per_token_n: np.ndarray
    layer_ids: np.ndarray
    """Hidden-layer index of each MoE layer, [L]."""

    def by_window(self, a_n: np.ndarray) -> np.ndarray:
        """Mean over each window's batches, [windows scored]."""
        wins = np.unique(self.window_n)
        return np.array([a_n[self.window_n == w].mean() for w in wins])

    def stat(self, a_n: np.ndarray) -> dict:
        w = self.by_window(a_n)
        return {"median": float(np.median(w)), "p95": float(np.percentile(w, 95)), "mean": float(w.mean())}

    def summary(self) -> dict:
        """JSON-ready: medians over windows at the top level, then median/p95 blocks."""
        fields = {
            "moe_step_seconds": self.plan_s_n, "contiguous_moe_step_seconds": self.contiguous_s_n,
            "ideal_moe_step_seconds": self.ideal_s_n, "straggler_time": self.straggler_time_n,
            "straggler_tokens": self.straggler_tokens_n, "contiguous_straggler_time": self.contiguous_straggler_time_n,
            "busiest_gpu_expert_seconds": self.busiest_compute_s_n,
            "contiguous_busiest_gpu_expert_seconds": self.contiguous_busiest_compute_s_n,
        }
        out: dict = {"dispatch": self.rule, "batches": self.how, "num_batches": int(len(self.plan_s_n)),
                     "num_windows": int(len(np.unique(self.window_n))),
                     "batch_tokens": self.stat(self.batch_tokens_n.astype(np.float64))["median"]}
        for key, a in fields.items():
            out[key] = self.stat(a)["median"]
        out["all_to_all_bytes_per_token"] = {"intra_node": self.stat(self.intra_bytes_per_token_n)["median"],
                                             "inter_node": self.stat(self.inter_bytes_per_token_n)["median"]}
        out["contiguous_all_to_all_bytes_per_token"] = {
            "intra_node": self.stat(self.contiguous_intra_bytes_per_token_n)["median"],
            "inter_node": self.stat(self.contiguous_inter_bytes_per_token_n)["median"]}
        tokens = self.batch_tokens_n.astype(np.float64)
        for name, s in (("plan", self.plan_s_n), ("contiguous", self.contiguous_s_n), ("ideal", self.ideal_s_n)):
            out[f"{name}_moe_tokens_per_second"] = self.stat(tokens / s)["median"]
        out["windows"] = {key: self.stat(a) for key, a in fields.items()}
        out["per_layer"] = {"layer_ids": self.layer_ids.tolist(),
                            "moe_seconds": self.plan_layer_s_nL.mean(axis=0).tolist(),
                            "contiguous_moe_seconds": self.contiguous_layer_s_nL.mean(axis=0).tolist(),
                            "ideal_moe_seconds": self.ideal_layer_s_nL.mean(axis=0).tolist()}
        return out


def check_shapes(cost: CostModel, placement: Placement, trace: Trace) -> None:
    """Refuse a plan that does not fit the trace or the model, naming both shapes."""
    L, E = trace.num_layers, trace.num_logical_experts
    if (placement.num_layers, placement.num_logical_experts) != (L, E):
        raise EplbError(f"the plan is {placement.num_layers} layers x {placement.num_logical_experts} experts but "
                        f"the trace is {L} layers x {E} experts: simulate a plan made from traces of the same model")
    cost.check_placement(placement)
    m = cost.model
    if L > m.num_moe_layers:
        raise EplbError(f"the trace has {L} MoE layers x {E} experts but {m.name} has {m.num_moe_layers} x "
                        f"{m.num_logical_experts}: pick the model the trace was recorded from")


def simulate(cost: CostModel, placement: Placement, trace: Trace, *, rule: str = "even",
             batch_tokens: int | None = None, batches_per_window: int = 8, seed: int = 0) -> SimulationReport:
    """Score `placement` on every batch of `trace` (see the module docstring)."""
    check_shapes(cost, placement, trace)
    batches, how = cut_batches(trace, cost.model.top_k, batch_tokens, batches_per_window, seed)
    base = contiguous_placement(placement.num_logical_experts, placement.topology, placement.layer_ids)
    dispatch = get_dispatch(rule, cost)
    bound_plan = dispatch.bind(placement)
    bound_base = get_dispatch("even", cost).bind(base)  # its only copies share a GPU: the rule cannot matter
    rows = []
    for b in batches:
        s = score_batch(cost, placement, bound_plan, b)
        c = score_batch(cost, base, bound_base, b)
        ideal_L = ideal_layer_seconds(cost, b.counts_LE, s)
        rows.append((b.tokens, b.window, s, c, ideal_L))
    st = [r[2] for r in rows]
    ct = [r[3] for r in rows]
    arr = np.array
    return SimulationReport(
        rule=dispatch.name, how=how, batch_tokens_n=arr([r[0] for r in rows]), window_n=arr([r[1] for r in rows]),
        plan_s_n=arr([s.seconds for s in st]), contiguous_s_n=arr([c.seconds for c in ct]),
        ideal_s_n=arr([r[4].sum() for r in rows]), plan_layer_s_nL=np.stack([s.layer_s_L for s in st]),
        contiguous_layer_s_nL=np.stack([c.layer_s_L for c in ct]), ideal_layer_s_nL=np.stack([r[4] for r in rows]),
        straggler_time_n=arr([s.straggler_time for s in st]), straggler_tokens_n=arr([s.straggler_tokens for s in st]),
        contiguous_straggler_time_n=arr([c.straggler_time for c in ct]),
        busiest_compute_s_n=arr([s.busiest_compute_seconds for s in st]),
        contiguous_busiest_compute_s_n=arr([c.busiest_compute_seconds for c in ct]),
        intra_bytes_per_token_n=arr([s.intra_bytes_per_token_L.sum() for s in st]),
        inter_bytes_per_token_n=arr([s.inter_bytes_per_token_L.sum() for s in st]),
        contiguous_intra_bytes_per_token_n=arr([c.intra_bytes_per_token_L.sum() for c in ct]),
        contiguous_inter_bytes_per_token_n=arr([c.inter_bytes_per_token_L.sum() for c in ct]),
        layer_ids=trace.layer_ids,
    )
