"""Measurements of the expert-parallel shim: per rank and layer, per step, and straggler ratios.

Legend: B = steps (batches), L = MoE layers, G = ranks.

Per rank and layer: rows received (the (token, expert) pairs a rank's experts computed: its
expert load), expert compute time (CPU time of the computing thread on CPU, since ranks share
cores and wall time would count the others' work; wall time after a sync on CUDA) and
all-to-all wall time. Per step: latency, the slowest rank's wall time for the whole step.
Straggler ratio = busiest rank / mean rank, per layer, on totals over the steps (each MoE
layer waits for its busiest rank, so the ratio is what the layer loses to imbalance).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from eplb.errors import EplbError


def straggler_ratio(load_G: np.ndarray) -> np.ndarray:
    """Busiest rank / mean rank over the last axis (1.0 where nothing was done)."""
    load = np.asarray(load_G, dtype=np.float64)
    mean = load.mean(axis=-1)
    return np.where(mean > 0, load.max(axis=-1) / np.where(mean > 0, mean, 1.0), 1.0)


def percentiles(values: np.ndarray, qs: tuple[float, ...] = (50, 95, 99)) -> dict[str, float]:
    """{"p50": ..., "p95": ..., "p99": ...} of a 1-D sample."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        raise EplbError("no steps were recorded: run at least one step inside Recorder.step()")
    return {f"p{q:g}": float(np.percentile(v, q)) for q in qs}


@dataclass(frozen=True, eq=False)
class RuntimeReport:
    """Everything the ranks recorded, gathered onto every rank."""

    rows_BLG: np.ndarray
    """Rows received per step, layer and rank, float64 [B, L, G]."""
    compute_s_BLG: np.ndarray
    """Expert compute seconds per step, layer and rank, [B, L, G]."""
    a2a_s_BLG: np.ndarray
    """All-to-all wall seconds per step, layer and rank, [B, L, G]."""
    step_s_BG: np.ndarray
    """Wall seconds of each step on each rank, [B, G]."""

    @property
    def straggler_tokens_L(self) -> np.ndarray:
        return straggler_ratio(self.rows_BLG.sum(axis=0))

    @property
    def straggler_time_L(self) -> np.ndarray:
        return straggler_ratio(self.compute_s_BLG.sum(axis=0))

    @property
    def step_latency_B(self) -> np.ndarray:
        """A step is done when its slowest rank is."""
        return self.step_s_BG.max(axis=1)

    def summary(self) -> dict:
        lat_ms = {k: 1e3 * v for k, v in percentiles(self.step_latency_B).items()}
        return {
            "steps": int(self.rows_BLG.shape[0]),
            "straggler_tokens": float(self.straggler_tokens_L.mean()),
            "straggler_time": float(self.straggler_time_L.mean()),
            "straggler_tokens_per_layer": self.straggler_tokens_L.round(4).tolist(),
            "straggler_time_per_layer": self.straggler_time_L.round(4).tolist(),
            "rows_received_per_layer_rank": self.rows_BLG.sum(axis=0).astype(np.int64).tolist(),
            "compute_ms_per_step_rank": (1e3 * self.compute_s_BLG.sum(axis=1).mean(axis=0)).round(3).tolist(),
            "a2a_ms_per_step_rank": (1e3 * self.a2a_s_BLG.sum(axis=1).mean(axis=0)).round(3).tolist(),
            "step_latency_ms": lat_ms,
        }


def backend_device(group: dist.ProcessGroup) -> torch.device:
    """Where a collective over `group` wants its tensors: this rank's current CUDA device for
    NCCL (which rejects CPU tensors), the CPU for gloo and the others."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Recorder:
    """Collects one rank's numbers, step by step, for a stack of L MoE layers.

        rec = Recorder(num_layers=L)
        with rec.step():
            for l, moe in enumerate(moes):
                y = moe(x, ids, w)
                rec.record(l, moe.last)
        report = rec.gather(group)      # collective: same RuntimeReport on every rank
    """

    def __init__(self, num_layers: int):
        if num_layers < 1:
            raise EplbError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = int(num_layers)
        self._rows: list[np.ndarray] = []
        self._compute: list[np.ndarray] = []
        self._a2a: list[np.ndarray] = []
        self._step_s: list[float] = []
        self._open = False

    @contextmanager
    def step(self, device: torch.device | str | None = None) -> Iterator[None]:
        """Time one step (pass a CUDA device to sync before reading the clock)."""
        L = self.num_layers
        self._rows.append(np.zeros(L))
        self._compute.append(np.zeros(L))
        self._a2a.append(np.zeros(L))
        self._open = True
        cuda = device is not None and torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(device)
            self._step_s.append(time.perf_counter() - t0)
            self._open = False

    def record(self, layer: int, stats) -> None:
        """Add one layer's `ExpertParallelMoE.last` to the open step."""
        if not self._open:
            raise EplbError("Recorder.record must be called inside `with recorder.step():`")
        if not 0 <= layer < self.num_layers:
            raise EplbError(f"layer {layer} is outside 0..{self.num_layers - 1}")
        self._rows[-1][layer] += stats.rows_received
        self._compute[-1][layer] += stats.compute_s
        self._a2a[-1][layer] += stats.a2a_s

    def local_arrays(self) -> np.ndarray:
        """This rank's numbers as one array [B, 3 * L + 1] (rows, compute, a2a, step seconds)."""
        return np.concatenate([np.stack(self._rows), np.stack(self._compute), np.stack(self._a2a),
                               np.asarray(self._step_s)[:, None]], axis=1)

    def gather(self, group: dist.ProcessGroup, device: torch.device | str | None = None) -> RuntimeReport:
        """All ranks' numbers on every rank (collective over `group`).

        device: where the exchange tensors live; default the group's backend's own (this
        rank's current CUDA device for NCCL, which rejects CPU tensors; the CPU otherwise).
        Ranks that recorded different numbers of steps or layers (or none) all raise EplbError."""
        device = backend_device(group) if device is None else device
        world = dist.get_world_size(group)
        # all_gather needs one shape on every rank (a mismatch aborted gloo and mixed up rows):
        # agree on [steps, layers] first, so that every rank raises the same error.
        shape = torch.tensor([len(self._step_s), self.num_layers], dtype=torch.int64, device=device)
        shapes = [torch.empty_like(shape) for _ in range(world)]
        dist.all_gather(shapes, shape, group=group)
        shape_G2 = torch.stack(shapes).tolist()
        if any(s != shape_G2[0] for s in shape_G2):
            raise EplbError(f"ranks recorded different [steps, layers]: {shape_G2} (by rank): every rank must "
                            f"run the same steps inside Recorder.step() with the same num_layers")
        if not self._step_s:
            raise EplbError("no steps were recorded: run at least one step inside Recorder.step()")
        mine = torch.as_tensor(self.local_arrays(), dtype=torch.float64, device=device)
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=group)
        a_GBC = torch.stack(parts).cpu().numpy()
        L = self.num_layers
        to_BLG = lambda a: np.transpose(a, (1, 2, 0))  # noqa: E731  [G, B, L] -> [B, L, G]
        return RuntimeReport(
            rows_BLG=to_BLG(a_GBC[:, :, :L]),
            compute_s_BLG=to_BLG(a_GBC[:, :, L:2 * L]),
            a2a_s_BLG=to_BLG(a_GBC[:, :, 2 * L:3 * L]),
            step_s_BG=a_GBC[:, :, 3 * L].T,
        )
