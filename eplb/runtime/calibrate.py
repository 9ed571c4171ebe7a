"""Measure the expert-parallel shim over placements x batch sizes, for `eplb calibrate`.

    python -m eplb calibrate --ranks 4 -o profile.json        # gloo ranks on this machine's CPU

Legend: C = cases, B = steps, L = MoE layers, G = ranks, S = slots per rank, E = logical
experts, K = top-k, T = tokens per rank, D = model dim, F = expert hidden dim.

Every case is one placement served for a few steps at one batch size. Ranks are started with
torch.multiprocessing (gloo on CPU, one torch thread each, so a rank's thread CPU time is its
whole expert computation; NCCL on one GPU per rank where CUDA is there, which is written but
untested here: no GPU was available). Traffic: each token picks K distinct experts from a
skewed popularity (Zipf, exponent `skew`, shuffled per layer), seeded identically on every rank.
A case's dispatch is "even" (the engines' rule) or "time" (`eplb.dispatch.timed.TimeDispatch`,
re-solved every step from the counts of all ranks, then served as per-step replica weights).
Rows per slot come from the same replica choice the layer makes (`choose_slots`), summed over
ranks, so the fit sees exactly which replicas were active.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eplb.core.hardware import get_hardware
from eplb.core.placement import Placement, contiguous_placement
from eplb.dispatch.calibration import ShimMeasurements, shim_model
from eplb.dispatch.cost import CostModel, TimeObjective
from eplb.dispatch.timed import TimeDispatch
from eplb.errors import EplbError, PlanningError
from eplb.planning.front_door import plan
from eplb.runtime.ep import ExpertParallelMoE, ReplicaTable, choose_slots


@dataclass(frozen=True, eq=False)
class ShimCase:
    """One placement at one batch size."""

    name: str
    placement: Placement
    tokens_per_rank: int
    dispatch: str = "even"
    """"even", or "time" (per-step time dispatch, which needs `cost`)."""
    cost: object = None
    """The CostModel of the time dispatch."""


@dataclass(frozen=True)
class ShimSettings:
    """Sizes of the shim's experts and of the run."""

    hidden: int = 512
    expert_hidden: int = 768
    top_k: int = 4
    steps: int = 3
    """Measured steps per case (after one warm-up step)."""
    skew: float = 1.0
    seed: int = 0


def popularity(num_layers: int, num_logical_experts: int, skew: float, seed: int) -> np.ndarray:
    """Expert popularity per layer [L, E]: Zipf(skew) over a per-layer shuffle of the experts."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, num_logical_experts + 1) ** skew
    return np.stack([base[rng.permutation(num_logical_experts)] for _ in range(num_layers)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(cases: list[ShimCase], num_ranks: int, settings: ShimSettings = ShimSettings(),
            backend: str | None = None) -> ShimMeasurements:
    """Run every case on `num_ranks` fresh processes and gather what they recorded."""
    import torch
    import torch.multiprocessing as mp

    if not cases:
        raise EplbError("no calibration cases")
    L, E = cases[0].placement.num_layers, cases[0].placement.num_logical_experts
    for c in cases:
        p = c.placement
        if (p.num_gpus, p.num_layers, p.num_logical_experts) != (num_ranks, L, E):
            raise EplbError(f"case {c.name!r}: placement is {p.num_gpus} GPUs x {p.num_layers} layers x "
                            f"{p.num_logical_experts} experts; every case needs {num_ranks} x {L} x {E}")
        if c.dispatch not in ("even", "time") or (c.dispatch == "time" and c.cost is None):
            raise EplbError(f"case {c.name!r}: dispatch must be 'even' or 'time' (with a cost model)")
    backend = backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= num_ranks else "gloo")
    with tempfile.TemporaryDirectory(prefix="eplb-calibrate-") as tmp:
        out = Path(tmp) / "measurements.npz"
        try:
            mp.spawn(_worker, args=(num_ranks, _free_port(), backend, cases, settings, str(out)),
                     nprocs=num_ranks, join=True)
        except mp.ProcessRaisedException as exc:
            raise PlanningError(f"a calibration rank failed: {str(exc).strip().splitlines()[-1]}") from None
        return ShimMeasurements.load(out)


def _worker(rank: int, world: int, port: int, backend: str, cases, settings: ShimSettings, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        group = dist.group.WORLD
        L, E = cases[0].placement.num_layers, cases[0].placement.num_logical_experts
        pop_LE = popularity(L, E, settings.skew, settings.seed)
        results = [_run_case(c, k, rank, world, group, device, settings, pop_LE) for k, c in enumerate(cases)]
        if rank == 0:
            arrays = [np.stack([r[i] for r in results]) for i in range(5)]
            ShimMeasurements(tuple(c.name for c in cases), np.array([c.tokens_per_rank for c in cases]), *arrays,
                             hidden=settings.hidden, expert_hidden=settings.expert_hidden, num_logical_experts=E,
                             top_k=settings.top_k, backend=backend).save(out)
        dist.barrier(group)
    finally:
        dist.destroy_process_group()


def _expert_weights(layer: int, expert: int, settings: ShimSettings, device):
    """One expert's (gate, up, down) weights, the same on every rank (seeded by layer and expert)."""
    import torch

    g = torch.Generator().manual_seed(settings.seed * 1_000_003 + layer * 10_007 + expert)
    D, F = settings.hidden, settings.expert_hidden
    w = torch.randn(3, F, D, generator=g) / D ** 0.5
    return w[0].to(device), w[1].to(device), w[2].T.contiguous().to(device)


def _run_case(case: ShimCase, k: int, rank: int, world: int, group, device, settings: ShimSettings, pop_LE):
    """Serve one case; returns this case's [B, L, G, S] rows and [B, L, G] compute, a2a, sent, received."""
    import torch
    import torch.distributed as dist

    p = case.placement
    L, S, P, E = p.num_layers, p.slots_per_gpu, p.num_slots, p.num_logical_experts
    T, K, B = case.tokens_per_rank, settings.top_k, settings.steps
    eps = []
    for l in range(L):
        mine = p.phy2log_LP[l, rank * S:(rank + 1) * S]
        w = [_expert_weights(l, int(e), settings, device) for e in mine]
        eps.append(ExpertParallelMoE(p, l, *(torch.stack([x[i] for x in w]) for i in range(3)), group=group,
                                     mode="even", sync_timing=device.type == "cuda"))
    solver = None
    if case.dispatch == "time":
        solver = TimeDispatch(case.cost).bind(p)
    pop = torch.tensor(pop_LE, dtype=torch.float64)
    rows = np.zeros((B, L, world, S))
    rec = np.zeros((4, B, L, world))                      # compute, a2a, sent, received
    for step in range(B + 1):                             # step 0 warms up
        g = torch.Generator().manual_seed(((settings.seed * 7919 + k) * 104_729 + step) * 131 + rank)
        ids_LTK = torch.stack([torch.multinomial(pop[l].expand(T, E), K, replacement=False, generator=g)
                               for l in range(L)])
        served = p
        if solver is not None:
            counts = torch.zeros(L, E, dtype=torch.int64)
            for l in range(L):
                counts[l] = torch.bincount(ids_LTK[l].reshape(-1), minlength=E)
            dist.all_reduce(counts, group=group)
            served = p.with_weights(solver(counts.numpy().astype(np.float64)))
        for l in range(L):
            mode = "even" if solver is None else "weights"
            if solver is not None:
                eps[l].set_placement(served, l, mode=mode)
            ids = ids_LTK[l].to(device)
            x = torch.randn(T, settings.hidden, generator=g).to(device)
            wts = torch.softmax(torch.randn(T, K, generator=g), dim=1).to(device)
            table = ReplicaTable.build(served, l, rank, device)
            slot_N = choose_slots(ids.reshape(-1), mode, table, rank, world)
            per_slot = torch.bincount(slot_N, minlength=P).to(torch.float64)
            dist.all_reduce(per_slot, group=group)
            eps[l](x, ids, wts)
            if step == 0:
                continue
            last = eps[l].last
            if last.rows_received != int(per_slot[rank * S:(rank + 1) * S].sum()):
                raise AssertionError(f"rank {rank}: computed {last.rows_received} rows, the replica choice says "
                                     f"{int(per_slot[rank * S:(rank + 1) * S].sum())}")
            mine = torch.tensor([last.compute_s, last.a2a_s, last.rows_sent, last.rows_received], dtype=torch.float64)
            everyone = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(everyone, mine.to(device) if device.type == "cuda" else mine, group=group)
            rec[:, step - 1, l] = torch.stack([e.cpu() for e in everyone]).T.numpy()
            rows[step - 1, l] = per_slot.cpu().numpy().reshape(world, S)
    return rows, rec[0], rec[1], rec[2], rec[3]


def default_cases(num_ranks: int, num_logical_experts: int = 32, num_layers: int = 2,
                  tokens_per_rank: tuple[int, ...] = (1, 2, 4, 8, 16, 32), settings: ShimSettings = ShimSettings(),
                  hardware="cpu") -> list[ShimCase]:
    """Four placements (contiguous; greedy on tokens; random with replicas; time-planned with the
    per-step time dispatch) x the batch sizes: 24 cases by default."""
    G, E, L = num_ranks, num_logical_experts, num_layers
    if G > E:
        raise EplbError(f"more ranks ({G}) than experts ({E})")
    pop_LE = popularity(L, E, settings.skew, settings.seed)
    S = min(-(-E // G) + 2, E)                       # two redundant slots per rank where they fit
    greedy = plan(pop_LE, num_gpus=G, slots_per_gpu=S, planner="greedy").placement
    cost = CostModel(shim_model(settings.hidden, settings.expert_hidden, E, settings.top_k, L), get_hardware(hardware),
                     expert_dtype="fp32", dispatch_dtype="fp32", combine_dtype="fp32")
    rng = np.random.default_rng(settings.seed)
    rows = []
    for _ in range(L):
        row = np.concatenate([rng.permutation(E), rng.integers(0, E, G * S - E)])
        rng.shuffle(row)
        rows.append(row)
    random = Placement(np.stack(rows), G, E, planner="random")
    contiguous = contiguous_placement(E, greedy.topology, greedy.layer_ids)
    cases = []
    for T in tokens_per_rank:
        timed = plan(pop_LE, num_gpus=G, slots_per_gpu=S, planner="greedy",
                     objective=TimeObjective(cost, batch_tokens=T * G)).placement
        cases += [ShimCase(f"contiguous, {T} tokens/rank", contiguous, T),
                  ShimCase(f"greedy tokens + even, {T} tokens/rank", greedy, T),
                  ShimCase(f"random + even, {T} tokens/rank", random, T),
                  ShimCase(f"greedy time + time dispatch, {T} tokens/rank", timed, T, "time", cost)]
    return cases


def local_world_size(requested: int) -> int:
    """Refuse more ranks than make sense on this machine's cores (gloo ranks share them)."""
    cores = os.cpu_count() or 1
    if requested > 4 * cores:
        raise EplbError(f"{requested} ranks on {cores} cores: each rank is a process; use at most {4 * cores}")
    return requested
