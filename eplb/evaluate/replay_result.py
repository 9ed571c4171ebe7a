"""What a replay measured: the per-window scores of each run and the result that reports them.

Legend: T = served windows, L = MoE layers, E = logical experts, P = physical slots,
R = dispatch rules scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eplb.core.topology import Topology


@dataclass(frozen=True, eq=False)
class RunScores:
    """Per-window scores of one run (the policy or a reference), one row per rule."""

    imbalance_RTL: np.ndarray
    """Busiest / mean GPU per rule, served window and layer, [R, T, L] (idle layers: 1)."""
    balancedness_RT: np.ndarray
    """vLLM's balancedness of each window (sum over layers of mean / busiest GPU), [R, T]."""
    seconds_RTL: np.ndarray | None = None
    """Modeled MoE seconds per step, per rule, window and layer (mean over the window's batches),
    [R, T, L], when Scoring.time was given."""


@dataclass(frozen=True, eq=False)
class ReplayResult:
    """Everything a replay measured; `summary()` is its JSON report, `arrays()` what `-o` writes."""

    policy: str
    settings: dict
    topology: Topology
    rules: tuple[str, ...]
    warmup: int
    delay: int
    window_T: np.ndarray
    """Index of each served window in the cut trace, [T]."""
    phy2log_TLP: np.ndarray
    """Placement in force while window t was served, int64 [T, L, P]."""
    weights_TLP: np.ndarray
    """Shares rule `weights_rule` used for window t, [T, L, P]: the time dispatch's over the
    window's batches when time was scored, else the first per-batch rule's (else the first's)."""
    weights_rule: str
    counts_TLE: np.ndarray
    """Logical counts of each served window, int64 [T, L, E]."""
    scores: RunScores
    references: dict
    """Reference name -> RunScores (static, hindsight)."""
    decided_T: np.ndarray
    """A decision was taken after serving window t (its moves follow), bool [T]."""
    applied_T: np.ndarray
    """A new placement took effect at window t, bool [T]."""
    moves_T: np.ndarray
    """Experts copied by the decision after window t, int64 [T] (0 without one)."""
    rounds_T: np.ndarray
    """Rounds of that decision's safe migration schedule, int64 [T]."""
    bytes_T: np.ndarray | None
    """Bytes of those copies, int64 [T] (None without bytes_per_expert)."""
    seconds: float
    """Wall time of the replay (references included)."""
    policy_seconds: float
    """Wall time the policy spent observing and deciding."""
    memory_bytes: int
    """The policy's load estimate, in bytes, at the end."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    time: dict | None = None
    """What modeled time was scored with (model, hardware, phase, batch tokens, batches), or None."""
    objective: str = "tokens"
    """What the policy and the references planned for ("tokens" or "time")."""

    def summary(self) -> dict[str, Any]:
        """JSON-ready report: overall figures per run and rule, then one entry per window."""
        runs = {"policy": self.scores, **self.references}
        L, P = self.phy2log_TLP.shape[1:]
        T = len(self.window_T)
        moves = int(self.moves_T.sum())
        out = {
            "policy_name": self.policy, "settings": self.settings, "rules": list(self.rules),
            "num_gpus": self.topology.num_gpus, "num_slots": self.topology.num_slots,
            "num_nodes": self.topology.num_nodes,
            "num_layers": int(L), "warmup": self.warmup, "delay": self.delay, "served_windows": T,
            "decisions": int(self.decided_T.sum()), "moves": moves, "moves_per_window": moves / T,
            "moves_per_window_share_of_slots": moves / T / (L * P),
            "rounds": int(self.rounds_T.sum()),
            "bytes": None if self.bytes_T is None else int(self.bytes_T.sum()),
            "seconds": self.seconds, "policy_seconds": self.policy_seconds, "memory_bytes": self.memory_bytes,
            "notes": list(self.notes), "objective": self.objective, "time": self.time,
        }
        for name, run in runs.items():
            out[name] = {r: _overall(run.imbalance_RTL[i], run.balancedness_RT[i],
                                     None if run.seconds_RTL is None else run.seconds_RTL[i])
                         for i, r in enumerate(self.rules)}
        out["per_window"] = [
            {"window": int(self.window_T[t]), "applied": bool(self.applied_T[t]), "decided": bool(self.decided_T[t]),
             "moves": int(self.moves_T[t]), "rounds": int(self.rounds_T[t]),
             "bytes": None if self.bytes_T is None else int(self.bytes_T[t]),
             **{name: {r: _window(run.imbalance_RTL[i, t], run.balancedness_RT[i, t],
                                  None if run.seconds_RTL is None else run.seconds_RTL[i, t])
                       for i, r in enumerate(self.rules)} for name, run in runs.items()}}
            for t in range(T)
        ]
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        """Named arrays for an .npz (see eplb.formats.replay): maps, shares, counts, metrics."""
        out = {"phy2log_TLP": self.phy2log_TLP, "weights_TLP": self.weights_TLP, "counts_TLE": self.counts_TLE,
               "window_T": self.window_T, "decided_T": self.decided_T, "applied_T": self.applied_T,
               "moves_T": self.moves_T, "rounds_T": self.rounds_T}
        if self.bytes_T is not None:
            out["bytes_T"] = self.bytes_T
        for name, run in {"policy": self.scores, **self.references}.items():
            out[f"{name}_imbalance_RTL"] = run.imbalance_RTL
            out[f"{name}_balancedness_RT"] = run.balancedness_RT
            if run.seconds_RTL is not None:
                out[f"{name}_seconds_RTL"] = run.seconds_RTL
        return out


def _overall(imbalance_TL: np.ndarray, balancedness_T: np.ndarray, seconds_TL: np.ndarray | None) -> dict:
    x = imbalance_TL.ravel()
    out = {"median": float(np.median(x)), "p95": float(np.percentile(x, 95)), "max": float(x.max()),
           "balancedness": float(balancedness_T.mean())}
    if seconds_TL is not None:
        step_T = seconds_TL.sum(axis=1)
        out["step_seconds"] = {"median": float(np.median(step_T)), "p95": float(np.percentile(step_T, 95)),
                               "mean": float(step_T.mean())}
    return out


def _window(imbalance_L: np.ndarray, balancedness: float, seconds_L: np.ndarray | None) -> dict:
    out = {"median": float(np.median(imbalance_L)), "p95": float(np.percentile(imbalance_L, 95)),
           "max": float(imbalance_L.max()), "balancedness": float(balancedness)}
    if seconds_L is not None:
        out["step_seconds"] = float(seconds_L.sum())
    return out
