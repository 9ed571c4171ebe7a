"""SGLang's `--ep-dispatch-algorithm lp` (its LPLB solver), modelled for scoring.

Legend: L = MoE layers, E = logical experts, G = GPUs (EP ranks), P = physical slots,
Q = slots of replicated experts in a layer, R = replicated experts in a layer,
C = LP rows (R + G, padded), V = LP columns (padded).

What SGLang 0.5.23 does (`sglang/srt/eplb/lplb_solver.py`, its kernels in
`sglang/kernels/jit/csrc/lplb/`), as modelled here:
- Counts: every rank counts its tokens per logical expert and an all-reduce sums them, so each
  MoE layer solves one LP per forward batch on the batch's *global* counts, divided by their
  total (at least 1).
- The LP of a layer: one variable per slot of an expert with two or more replicas (two copies
  on one GPU are two variables), a slack per GPU, the busiest load t and one artificial
  variable that makes x = 1 a feasible start (Big-M, weight 1000). Experts with one replica are
  fixed loads on their GPU. Minimise t + 1000 x artificial subject to: the slots of each
  replicated expert carry its share; each GPU's fixed load, its slots and its slack sum to t.
  So the LP is the re-split optimum (eplb's `resplit` rule, `optimal_weights`) ...
- ... solved inexactly: five steps of primal affine scaling (Dikin's method) from x = 1 in
  float32. Each step scales by x^2, solves the normal equations (A X^2 A^T) y = A X^2 c
  (Cholesky, pivots clamped at 1e-12), takes the scaled reduced costs d = x (c - A^T y) and
  moves x <- x (1 - 0.999 d / max d) (no move when max d <= 1e-9). The answer is kept when the
  last max d < 0.1, the artificial variable < 1e-4 and |A x - b| < 0.05; otherwise every
  variable is 0.5, i.e. the even split among each expert's replicas. On the shipped synthetic
  DeepSeek-V3 trace (32 GPUs, 288 slots) five steps leave the busiest GPU a median 0.4% and at
  most 6% above the LP optimum (docs/dispatch.md).
- Shares: each (token, expert) draws one slot of the rank's candidate list with probability
  proportional to the solution (all zero: uniform). After a rebalance the list is every
  replica, so the shares are the LP's. At start-up from a map (`--init-expert-location FILE`,
  with the all-to-all backend `lp` requires) each rank's list is collapsed to its nearest
  replica first (eplb.dispatch.sglang): a rank whose GPU holds the expert, or whose node holds
  some but not all of its replicas, sends all its tokens there, and only the other ranks follow
  the LP. As for SGLang's other rules, every rank is assumed to hold 1 / G of each expert's tokens.
- Limits: one CUDA block holds a layer's whole LP in shared memory; SGLang refuses at start-up a
  layer whose `4 (C V + C^2 + 3 V + C) + 256` bytes exceed 223 KiB (`shmem_budget.assert_fits`,
  C = R + G rows, V = Q + G + 2 columns): `lp_fits` says which layers do. It serves the DeepSeek
  V2 / V3 family only, and needs an all-to-all MoE backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.core.placement import Placement
from eplb.dispatch.sglang import _candidates, _check_path
from eplb.errors import EplbError, whole_number

STEPS = 5
"""Affine-scaling steps SGLang's kernel makes (`DEFAULT_NUM_ITERS`)."""
BIG_M = 1000.0
"""Cost of the artificial variable."""
SHMEM_BUDGET = 223 * 1024
"""Shared memory SGLang allows one LP on Hopper (bytes, `shmem_budget.GPU_BUDGETS_BYTES`)."""


def lp_bytes(phy2log_LP: np.ndarray, num_gpus: int) -> np.ndarray:
    """Shared memory SGLang's check charges each layer's LP, int64 [L] bytes."""
    phy2log_LP = np.asarray(phy2log_LP, dtype=np.int64)
    L, P = phy2log_LP.shape
    E = int(phy2log_LP.max()) + 1
    count_LE = np.bincount((np.arange(L)[:, None] * E + phy2log_LP).ravel(), minlength=L * E).reshape(L, E)
    R = (count_LE > 1).sum(axis=1)
    Q = np.where(count_LE > 1, count_LE, 0).sum(axis=1)
    C, V = R + num_gpus, Q + num_gpus + 2
    return 4 * (C * V + C * C + 3 * V + C) + 256


def lp_fits(phy2log_LP: np.ndarray, num_gpus: int) -> np.ndarray:
    """Which layers SGLang's `lp` can hold in one block's shared memory, bool [L]."""
    return lp_bytes(phy2log_LP, num_gpus) <= SHMEM_BUDGET


@dataclass(frozen=True, eq=False)
class _Program:
    """The LPs of all layers, padded to one shape: rows [replicated experts (R max), GPUs],
    columns [their slots (Q max), one per padding row (R max), slacks (G), t, artificial].
    Padding rows hold 1 on their own column with right-hand side 1 and padding columns are
    empty, so neither changes a step of the real LP (its normal equations are block-diagonal)."""

    A_LCV: np.ndarray
    """float32 [L, C, V], the artificial column left 0 (it follows the counts)."""
    c_V: np.ndarray
    """float32 [V]."""
    slot_LQ: np.ndarray
    """Slot of each replicated-slot column, -1 for padding, int64 [L, Q]."""
    rep_LR: np.ndarray
    """Expert of each replicated-expert row, -1 for padding, int64 [L, R]."""
    fixed_LEG: np.ndarray
    """float32 [L, E, G]: 1 where expert e has one replica, on GPU g."""


def _program(placement: Placement) -> _Program:
    phy, G = placement.phy2log_LP, placement.num_gpus
    L, P = phy.shape
    E = placement.num_logical_experts
    count_LE = placement.replica_count_LE
    gpu_P = placement.gpu_of_slot()
    rep_LP = np.take_along_axis(count_LE, phy, axis=1) > 1
    Q, R = int(rep_LP.sum(axis=1).max()), int((count_LE > 1).sum(axis=1).max())
    C, V = R + G, Q + G + 2 + R
    A = np.zeros((L, C, V), dtype=np.float32)
    slot_LQ = np.full((L, Q), -1, dtype=np.int64)
    rep_LR = np.full((L, R), -1, dtype=np.int64)
    for l in range(L):
        slots = np.flatnonzero(rep_LP[l])
        experts = np.flatnonzero(count_LE[l] > 1)
        slot_LQ[l, :len(slots)] = slots
        rep_LR[l, :len(experts)] = experts
        row = np.searchsorted(experts, phy[l, slots])
        # An expert's slots carry its share; a GPU's slots, slack and fixed load make t.
        A[l, row, np.arange(len(slots))] = 1.0
        A[l, R + gpu_P[slots], np.arange(len(slots))] = 1.0
        pad = np.arange(len(experts), R)
        A[l, pad, Q + pad] = 1.0
    A[:, R + np.arange(G), Q + R + np.arange(G)] = 1.0
    A[:, R:, Q + R + G] = -1.0
    c = np.zeros(V, dtype=np.float32)
    c[V - 2], c[V - 1] = 1.0, BIG_M
    fixed = np.zeros((L, E, G), dtype=np.float32)
    l_i, p_i = np.nonzero(~rep_LP)
    fixed[l_i, phy[l_i, p_i], gpu_P[p_i]] = 1.0
    return _Program(A, c, slot_LQ, rep_LR, fixed)


def _cholesky_solve(K: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve K y = rhs for a batch of symmetric K [B, N, N] as SGLang's kernel does: Cholesky
    with every pivot clamped at 1e-12 (so a near-singular system still solves)."""
    a = K.copy()
    N = a.shape[1]
    for k in range(N):
        a[:, k, k] = np.sqrt(np.maximum(a[:, k, k], np.float32(1e-12)))
        a[:, k + 1:, k] /= a[:, k, k][:, None]
        col = a[:, k + 1:, k]
        a[:, k + 1:, k + 1:] -= col[:, :, None] * col[:, None, :]
    y = rhs.copy()
    for i in range(N):  # forward: L z = rhs
        y[:, i] = (y[:, i] - np.einsum("bj,bj->b", a[:, i, :i], y[:, :i])) / a[:, i, i]
    for i in range(N - 1, -1, -1):  # back: L^T y = z
        y[:, i] = (y[:, i] - np.einsum("bj,bj->b", a[:, i + 1:, i], y[:, i + 1:])) / a[:, i, i]
    return y


def affine_scaling(A: np.ndarray, b: np.ndarray, c: np.ndarray, steps: int = STEPS) -> tuple[np.ndarray, np.ndarray]:
    """`steps` steps of primal affine scaling from x = 1 for min c x, A x = b, x >= 0, a batch at
    once (float32, as SGLang's kernel). A [B, C, V], b [B, C], c [V]; the last column is the
    artificial variable. Returns (x [B, V], kept [B]: SGLang's acceptance test; the rows it fails
    hold 0.5 everywhere)."""
    A, b, c = A.astype(np.float32), b.astype(np.float32), c.astype(np.float32)
    x = np.ones(A.shape[0:1] + A.shape[2:], dtype=np.float32)
    d_max = np.zeros(len(A), dtype=np.float32)
    for _ in range(steps):
        ax2 = A * (x * x)[:, None, :]
        y = _cholesky_solve(ax2 @ np.swapaxes(A, 1, 2), ax2 @ c)
        d = x * (c[None] - np.einsum("bcv,bc->bv", A, y))
        d_max = np.maximum(d.max(axis=1), 0.0)
        alpha = np.where(d_max > 1e-9, np.float32(0.999) / np.where(d_max > 1e-9, d_max, 1), 1.0).astype(np.float32)
        x = x * (1 - alpha[:, None] * d)
    resid = np.abs(np.einsum("bcv,bv->bc", A, x) - b).max(axis=1)
    art = x[:, -1]
    with np.errstate(invalid="ignore"):
        kept = (d_max < 0.1) & (art >= 0) & (art < 1e-4) & (resid < 0.05)
    return np.where(kept[:, None], x, np.float32(0.5)), kept


@dataclass(frozen=True)
class SglangLp:
    """SGLang `--ep-dispatch-algorithm lp`: a per-batch LP over each replicated expert's slots,
    solved by STEPS affine-scaling steps (module docstring).

    path: "startup" (a map from `--init-expert-location FILE`: ranks holding a replica, or on a
    node holding some, keep their tokens there) or "rebalance" (after SGLang's periodic
    rebalance, or a start-up plan from statistics: every rank follows the LP).
    """

    path: str = "startup"
    prefer_same_node: bool = True
    """False under elastic-EP scale-up (`ep_join_mode=scale`), where SGLang skips the node step."""
    steps: int = STEPS
    name = "sglang-lp"
    per_batch = True

    def __post_init__(self) -> None:
        _check_path(self.path)
        whole_number("steps", self.steps, 1)

    def bind(self, placement: Placement):
        fits = lp_fits(placement.phy2log_LP, placement.num_gpus)
        if not fits.all():
            l = int(np.flatnonzero(~fits)[0])
            need = int(lp_bytes(placement.phy2log_LP[l:l + 1], placement.num_gpus)[0])
            raise EplbError(f"layer {int(placement.layer_ids[l])}: SGLang's lp solver needs {need / 1024:.0f} KiB of "
                            f"shared memory for {placement.num_gpus} GPUs and its replicated experts, more than the "
                            f"{SHMEM_BUDGET // 1024} KiB it allows, so SGLang refuses it at start-up: fewer redundant "
                            f"slots or GPUs, or serve with --ep-dispatch-algorithm static / dynamic")
        prog = _program(placement)
        L, P = placement.phy2log_LP.shape
        G = placement.num_gpus
        cnt_LP = np.take_along_axis(placement.replica_count_LE, placement.phy2log_LP, axis=1)
        # Fixed part of the shares: ranks sending all their tokens to their nearest slot.
        local_LP = np.zeros((L, P))
        free_LE = np.full(placement.replica_count_LE.shape, float(G))  # ranks that follow the LP
        if self.path == "startup":
            c = _candidates(placement.phy2log_LP, G, placement.num_nodes, self.prefer_same_node)
            l_i, e_i, g_i = np.nonzero((c.nearest_HEG >= 0) & (c.count_HE > 1)[:, :, None])
            np.add.at(local_LP, (l_i, c.nearest_HEG[l_i, e_i, g_i]), 1.0 / G)
            free_LE = (c.nearest_HEG < 0).sum(axis=2).astype(np.float64)
        free_LP = np.take_along_axis(free_LE, placement.phy2log_LP, axis=1) / G
        R = prog.rep_LR.shape[1]
        rows = np.arange(L)[:, None]

        def shares(counts_LE):
            counts = np.asarray(counts_LE, dtype=np.float64)
            if counts.shape != (L, placement.num_logical_experts):
                raise EplbError(f"counts have shape {counts.shape}, the placement needs "
                                f"{(L, placement.num_logical_experts)} [layers, logical experts]")
            f = (counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)).astype(np.float32)
            b = np.ones((L, R + G), dtype=np.float32)
            b[:, :R] = np.where(prog.rep_LR >= 0, f[rows, np.maximum(prog.rep_LR, 0)], 1.0)
            b[:, R:] = -np.einsum("le,leg->lg", f, prog.fixed_LEG)
            A = prog.A_LCV.copy()
            A[:, :, -1] = b - A.sum(axis=2)
            x, _ = affine_scaling(A, b, prog.c_V, self.steps)
            x_LP = np.zeros((L, P))
            valid = prog.slot_LQ >= 0
            l_q, q_q = np.nonzero(valid)
            x_LP[l_q, prog.slot_LQ[l_q, q_q]] = np.maximum(x[l_q, q_q], 0.0)
            sum_LE = np.zeros(placement.replica_count_LE.shape)
            np.add.at(sum_LE, (np.broadcast_to(rows, (L, P)), placement.phy2log_LP), x_LP)
            sum_LP = np.take_along_axis(sum_LE, placement.phy2log_LP, axis=1)
            lp_LP = np.where(sum_LP > 0, x_LP / np.where(sum_LP > 0, sum_LP, 1.0), 1.0 / cnt_LP)
            return np.where(cnt_LP > 1, local_LP + free_LP * lp_LP, 1.0)

        def bound(counts_LE):
            if counts_LE is None:
                raise EplbError(f"dispatch rule {self.name!r} splits each batch by its own counts: pass counts [L, E]")
            return shares(counts_LE)

        return bound
