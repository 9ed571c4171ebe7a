"""Trace: router statistics over time, the input of every planner.

Legend: T = time windows, L = MoE layers, E = logical experts, N = tokens, K = top-k.

A Trace holds `counts_TLE` (token-slots routed to each logical expert per window and layer),
the MoE layers' hidden-layer ids, provenance `meta`, and optionally per-token expert choices
(`topk_ids_NLK`, with `token_window_N`). It does no file I/O: eplb.formats reads and writes
traces (`eplb.load_trace`, `eplb.save_trace`; the `.npz` schema is in traces/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eplb.errors import EplbError, is_whole, number_array, readonly, settings_map

REQUIRED_META = (
    "model", "num_hidden_layers", "num_experts", "top_k", "num_expert_groups",
    "tokens_per_window", "source", "synthetic",
)
WHOLE_META = ("num_hidden_layers", "num_experts", "top_k", "num_expert_groups", "tokens_per_window")
"""Meta fields that are whole numbers >= 1 when known (None when not)."""
MAX_COUNT = 2**62
"""Largest token count accepted, and the largest sum of a trace's counts: every total over
windows, layers or experts then fits int64 (which wraps silently past 2**63)."""


def default_meta(num_layers_total: int, num_logical_experts: int, **overrides: Any) -> dict[str, Any]:
    """Meta for a trace whose origin says little: unknown fields are None."""
    meta: dict[str, Any] = {
        "model": None,
        "num_hidden_layers": int(num_layers_total),
        "num_experts": int(num_logical_experts),
        "top_k": None,
        "num_expert_groups": None,
        "tokens_per_window": None,
        "source": None,
        "synthetic": False,
    }
    meta.update(overrides)
    return meta


@dataclass(frozen=True, eq=False)
class Trace:
    """Per-window, per-layer, per-expert token counts of one model, with provenance."""

    counts_TLE: np.ndarray
    """Token-slots routed to each logical expert, int64 [T, L, E]."""
    layer_ids: np.ndarray
    """Hidden-layer index of each MoE layer, int64 [L], strictly increasing."""
    meta: dict = field(default_factory=dict)
    """Provenance and model shape; keys in REQUIRED_META (unknown values are None)."""
    topk_ids_NLK: np.ndarray | None = None
    """Optional per-token expert choices, int16 [N, L, K]."""
    token_window_N: np.ndarray | None = None
    """Window index of each per-token row, int32 [N] (required with topk_ids_NLK)."""

    def __post_init__(self) -> None:
        c = number_array("counts", self.counts_TLE)
        if c.ndim != 3:
            raise EplbError(f"counts must be 3-D [windows, layers, experts], got shape {c.shape}")
        if c.dtype.kind == "f":
            if not np.all(np.isfinite(c)):
                raise EplbError("counts contain NaN or infinite values")
            if not np.all(c == np.round(c)):
                raise EplbError("counts must be whole token counts, got fractional values")
        elif c.dtype.kind not in "iu":
            raise EplbError(f"counts must be integers, got dtype {c.dtype}")
        if c.size and float(c.max()) > MAX_COUNT:  # uint64 or float values past int64 would wrap on conversion
            raise EplbError(f"counts hold {c.max():g}, too large for a token count (at most 2**62)")
        total = float(c.sum(dtype=np.float64)) if c.size else 0.0
        if total > MAX_COUNT:  # then every sum of them (per layer, over windows) fits int64 exactly
            raise EplbError(f"counts sum to {total:g} over all windows, layers and experts, more than 2**62: "
                            f"their int64 sums (totals over windows) would overflow; token counts are far smaller")
        if c.size and c.min() < 0:
            t, l, e = np.argwhere(c < 0)[0]
            raise EplbError(f"counts must be >= 0, got {c[t, l, e]} at window {t}, layer {l}, expert {e}")
        T, L, E = c.shape
        if T < 1 or L < 1 or E < 1:
            raise EplbError(f"counts must have at least one window, layer and expert, got shape {c.shape}")
        ids = number_array("layer_ids", self.layer_ids)
        if ids.shape != (L,) or ids.dtype.kind not in "iu":
            raise EplbError(f"layer_ids must be {L} integers (one per MoE layer), got shape {ids.shape} "
                            f"dtype {ids.dtype}")
        if ids.min() < 0 or np.any(np.diff(ids) <= 0):
            raise EplbError(f"layer_ids must be non-negative and strictly increasing, got {ids.tolist()}")
        meta = settings_map("trace meta", self.meta)
        missing = [k for k in REQUIRED_META if k not in meta]
        if missing:
            raise EplbError(f"trace meta is missing key(s): {', '.join(missing)}")
        for key in WHOLE_META:  # int(v) below and in planners would truncate 2.5 or fail on "abc"
            v = meta[key]
            if v is None:
                continue
            if not is_whole(v) or v < 1:
                raise EplbError(f"meta {key} must be a whole number >= 1 or null, got {v!r}")
            meta[key] = int(v)
        if meta["num_expert_groups"] is not None and E % meta["num_expert_groups"]:
            raise EplbError(f"meta num_expert_groups ({meta['num_expert_groups']}) must divide the {E} experts "
                            f"(group-limited routing uses equal groups); fix the meta or set it to null")
        if meta["num_experts"] is not None and int(meta["num_experts"]) != E:
            raise EplbError(f"meta num_experts ({meta['num_experts']}) does not match counts ({E} experts)")
        nh = meta["num_hidden_layers"]
        if nh is not None and int(nh) <= int(ids.max()):
            raise EplbError(f"meta num_hidden_layers ({nh}) must exceed the largest layer id ({int(ids.max())})")
        if not isinstance(meta["synthetic"], bool):
            raise EplbError(f"meta synthetic must be true or false, got {meta['synthetic']!r}")
        object.__setattr__(self, "counts_TLE", readonly(c.astype(np.int64)))
        object.__setattr__(self, "layer_ids", readonly(ids.astype(np.int64)))
        object.__setattr__(self, "meta", meta)
        if (self.topk_ids_NLK is None) != (self.token_window_N is None):
            raise EplbError("topk_ids and token_window must be given together")
        if self.topk_ids_NLK is not None:
            k = np.asarray(self.topk_ids_NLK)
            w = np.asarray(self.token_window_N)
            if k.ndim != 3 or k.shape[1] != L or k.dtype.kind not in "iu":
                raise EplbError(f"topk_ids must be integers [tokens, {L}, top_k], got shape {k.shape} dtype {k.dtype}")
            if k.size and (k.min() < 0 or k.max() >= E):
                raise EplbError(f"topk_ids hold expert ids outside 0..{E - 1}")
            if w.shape != (k.shape[0],) or w.dtype.kind not in "iu":
                raise EplbError(f"token_window must be {k.shape[0]} integers, got shape {w.shape}")
            if w.size and (w.min() < 0 or w.max() >= T or np.any(np.diff(w) < 0)):
                raise EplbError(f"token_window must be non-decreasing window indices in 0..{T - 1}")
            object.__setattr__(self, "topk_ids_NLK", readonly(k.astype(np.int16)))
            object.__setattr__(self, "token_window_N", readonly(w.astype(np.int32)))

    @property
    def num_windows(self) -> int:
        return self.counts_TLE.shape[0]

    @property
    def num_layers(self) -> int:
        return self.counts_TLE.shape[1]

    @property
    def num_logical_experts(self) -> int:
        return self.counts_TLE.shape[2]

    def total(self) -> np.ndarray:
        """Sum over all windows, int64 [L, E]."""
        return self.counts_TLE.sum(axis=0)

    def windows(self, start: int, stop: int | None = None) -> Trace:
        """The windows start..stop-1 as a trace of their own (per-token rows dropped)."""
        c = self.counts_TLE[start:stop]
        if c.shape[0] == 0:
            raise EplbError(f"window range {start}:{stop} is empty (trace has {self.num_windows} windows)")
        return Trace(c, self.layer_ids, dict(self.meta))
