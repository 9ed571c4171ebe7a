"""The rule-aware plan fitted to the placement served now, without changing what the rule serves.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots,
U = units (nodes when N > 1, else GPUs), Q = GPUs per unit.

Under a "unit" rule (planners.rule_aware) the shares depend only on which units hold each
replicated expert, so a plan can be fitted to the previous placement (fewer copies) in three
ways that keep its balance, each exactly or in expectation:
- `match_units`: rename the units of each layer's unit layout before packing (an assignment
  per layer: new unit -> old unit keeping the most replicated experts on units that hold them
  already). The shares are bound after the renaming, so the packing uses the real ones.
- the packing prefers a GPU that holds the expert already while that stays within a cap on
  the GPU's load (`rule_aware._pack`, `held_LGE`).
- `fit_gpus`: rename the GPUs inside each unit after packing (an assignment per layer and
  unit). Which units hold an expert does not change, so neither do the shares.
"""

from __future__ import annotations

import numpy as np


def held_by_gpu(previous_LP: np.ndarray, num_gpus: int, num_logical_experts: int) -> np.ndarray:
    """Does GPU g hold expert e in the previous placement, bool [L, G, E] (empty slots, -1, hold nothing)."""
    L, P = previous_LP.shape
    S = P // num_gpus
    held_LGE = np.zeros((L, num_gpus, num_logical_experts), dtype=bool)
    l_i, p_i = np.nonzero(previous_LP >= 0)
    held_LGE[l_i, p_i // S, previous_LP[l_i, p_i]] = True
    return held_LGE


def moves_per_layer(held_LGE: np.ndarray, phy2log_LP: np.ndarray) -> np.ndarray:
    """Replicas of phy2log_LP on a GPU that did not hold their expert before, int64 [L]."""
    L, G, _ = held_LGE.shape
    S = phy2log_LP.shape[1] // G
    gpu_P = np.arange(phy2log_LP.shape[1]) // S
    return (~held_LGE[np.arange(L)[:, None], gpu_P[None, :], phy2log_LP]).sum(axis=1)


def match_units(units_LEU: np.ndarray, held_LGE: np.ndarray) -> np.ndarray:
    """units_LEU with each layer's units renamed to keep the most replicated experts in place.

    units_LEU: int [L, E, U] (1 = a replica of e on unit u); held_LGE: bool [L, G, E]. Unit u
    takes the name of old unit v maximising the experts of u that v holds on some GPU.
    """
    from scipy.optimize import linear_sum_assignment

    L, E, U = units_LEU.shape
    G = held_LGE.shape[1]
    held_LEU = held_LGE.reshape(L, U, G // U, E).any(axis=2).transpose(0, 2, 1)
    keep_LUU = np.einsum("leu,lev->luv", units_LEU.astype(np.float64), held_LEU.astype(np.float64))
    out_LEU = np.empty_like(units_LEU)
    for l in range(L):
        new_u, old_v = linear_sum_assignment(keep_LUU[l], maximize=True)
        out_LEU[l][:, old_v] = units_LEU[l][:, new_u]
    return out_LEU


def fit_gpus(phy2log_LP: np.ndarray, held_LGE: np.ndarray, num_units: int) -> np.ndarray:
    """phy2log_LP with the GPUs of each unit renamed to keep the most replicas in place.

    Only GPUs of one unit trade places, so every unit holds the same experts as before and
    the unit rule's shares stay the same. On one node (units are GPUs) nothing changes.
    """
    from scipy.optimize import linear_sum_assignment

    L, G, E = held_LGE.shape
    P = phy2log_LP.shape[1]
    S, Q = P // G, G // num_units
    if Q == 1:
        return phy2log_LP
    new_LGE = held_by_gpu(phy2log_LP, G, E)
    out_LGS = phy2log_LP.reshape(L, G, S).copy()
    for l in range(L):
        for u in range(num_units):
            gpus = np.arange(u * Q, (u + 1) * Q)
            keep_QQ = new_LGE[l, gpus].astype(np.float64) @ held_LGE[l, gpus].T.astype(np.float64)
            new_q, old_q = linear_sum_assignment(keep_QQ, maximize=True)
            out_LGS[l, gpus[old_q]] = phy2log_LP.reshape(L, G, S)[l, gpus[new_q]]
    return out_LGS.reshape(L, P)
