"""Reference for the per-batch re-split (eplb.dispatch.Resplitter), kept as a test oracle: the
rule as it was before it became a wrapper over eplb/dispatch/resplit_score.py, with its own
index tables and a greedy colouring per layer (most GPUs first) instead of `colour_classes`.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S physical
slots, C = colours, K = experts per colour, X = most replicas of one expert.
"""

from __future__ import annotations

import numpy as np

from eplb.core.placement import Placement
from eplb.dispatch.rules import _check_load, _even_LP, _shares_to_weights
from eplb.errors import EplbError


class Resplitter:
    """Per-batch re-splitting for one placement: build once (index tables), call per batch.

    `Resplitter(placement)(counts_LE, sweeps=8)` returns weights [L, P]. Only experts with
    replicas on >= 2 distinct GPUs can move tokens. They are coloured so that experts of one
    colour share no GPU: all experts of a colour (in every layer) water-fill in one numpy
    step, exactly as if done one after another. Tables are [L, C, K, X]: C colours, K experts
    per colour, X slots per expert (one per distinct GPU; a second copy on the same GPU gets
    weight 0, since it cannot change that GPU's load), padded with dummy slot P / GPU G.
    `warm=True` starts from the previous call's shares, as a serving loop would (counts of
    consecutive batches are alike, so fewer sweeps are needed).
    """

    def __init__(self, placement: Placement):
        if not isinstance(placement, Placement):
            raise EplbError(f"Resplitter needs a Placement, got {type(placement).__name__}")
        self.placement = placement
        phy2log_LP = placement.phy2log_LP
        L, P = phy2log_LP.shape
        G, S = placement.num_gpus, placement.slots_per_gpu
        gpu_P = placement.gpu_of_slot()
        rows = np.arange(L)[:, None]
        log2phy_LEX = placement.log2phy_LEX
        X = log2phy_LEX.shape[2]
        gpu_LEX = np.where(log2phy_LEX >= 0, gpu_P[np.maximum(log2phy_LEX, 0)], -1)
        # use: the first slot of an expert on each GPU it occupies.
        use_LEX = log2phy_LEX >= 0
        for j in range(1, X):
            dup = (gpu_LEX[:, :, :j] == gpu_LEX[:, :, j:j + 1]).any(axis=2)
            use_LEX[:, :, j] &= ~dup
        n_gpus_LE = use_LEX.sum(axis=2)
        # Starting point: the engine's even split (1 / replicas), so that every sweep, which
        # never raises the busiest GPU it touches, stays at or below the even split.
        self.start_LP = _even_LP(placement)
        # A second copy of an expert on one GPU takes no part in water-filling: its tokens are
        # moved to the expert's first slot on that GPU (same GPU load) before the sweeps, or
        # the sweeps would redistribute the expert's load while the copy kept its share too.
        # home_LP: that first slot, for every slot; None when no GPU holds two copies.
        self._home_flat = None
        phy2log_LGS = phy2log_LP.reshape(L, G, S)
        same_LGSS = phy2log_LGS[:, :, :, None] == phy2log_LGS[:, :, None, :]
        if (same_LGSS.sum(axis=3) > 1).any():
            home_LGS = same_LGSS.argmax(axis=3) + (np.arange(G) * S)[None, :, None]
            self._home_flat = (home_LGS.reshape(L, P) + (np.arange(L) * P)[:, None]).ravel()
        # Greedy colouring, per layer, of the experts that span >= 2 GPUs (most replicas first).
        groups: list[list[list[int]]] = []  # groups[l][c] = experts of colour c in layer l
        for l in range(L):
            multi = np.flatnonzero(n_gpus_LE[l] >= 2)
            multi = multi[np.argsort(-n_gpus_LE[l, multi], kind="stable")]
            colour_of_gpu: list[set[int]] = [set() for _ in range(G)]
            layer: list[list[int]] = []
            for e in multi:
                gpus = gpu_LEX[l, e][use_LEX[l, e]]
                taken = set().union(*(colour_of_gpu[g] for g in gpus))
                c = next(c for c in range(len(layer) + 1) if c not in taken)
                if c == len(layer):
                    layer.append([])
                layer[c].append(int(e))
                for g in gpus:
                    colour_of_gpu[g].add(c)
            groups.append(layer)
        C = max((len(layer) for layer in groups), default=0)
        K = max((len(c) for layer in groups for c in layer), default=0)
        self.expert_LCK = np.zeros((L, C, K), dtype=np.int64)
        self.valid_LCK = np.zeros((L, C, K), dtype=bool)
        for l, layer in enumerate(groups):
            for c, experts in enumerate(layer):
                self.expert_LCK[l, c, :len(experts)] = experts
                self.valid_LCK[l, c, :len(experts)] = True
        r4 = rows[:, :, None, None]
        e4 = self.expert_LCK[:, :, :, None]
        x4 = np.arange(X)
        self.use_LCKX = use_LEX[r4, e4, x4] & self.valid_LCK[:, :, :, None]
        self.slot_LCKX = np.where(self.use_LCKX, log2phy_LEX[r4, e4, x4], P)
        self.gpu_LCKX = np.where(self.use_LCKX, gpu_LEX[r4, e4, x4], G)
        self.num_gpus, self.slots_per_gpu = G, S
        self.C, self.X = C, X
        # Flat indices into the [L, P + 1] flow and [L, G + 1] GPU-load buffers, per colour.
        K = self.slot_LCKX.shape[2]
        layer = np.arange(L)[:, None, None, None]
        self._slot_C = (layer * (P + 1) + self.slot_LCKX).transpose(1, 0, 2, 3).reshape(C, L * K, X)
        self._gpu_C = (layer * (G + 1) + self.gpu_LCKX).transpose(1, 0, 2, 3).reshape(C, L * K, X)
        self._last_LP: np.ndarray | None = None

    def __call__(self, counts_LE, sweeps: int = 8, warm: bool = False) -> np.ndarray:
        """Weights [L, P] for the loads `counts_LE` [L, E] after `sweeps` passes over the experts."""
        p = self.placement
        load = _check_load(p, counts_LE)
        if isinstance(sweeps, bool) or not isinstance(sweeps, (int, np.integer)) or sweeps < 0:
            raise EplbError(f"sweeps must be an integer >= 0, got {sweeps!r}")
        L, P = p.phy2log_LP.shape
        G, S = self.num_gpus, self.slots_per_gpu
        start_LP = self._last_LP if (warm and self._last_LP is not None) else self.start_LP
        flow_LP = np.zeros((L, P + 1))
        flow_LP[:, :P] = np.take_along_axis(load, p.phy2log_LP, axis=1) * start_LP
        if self._home_flat is not None:
            flow_LP[:, :P] = np.bincount(self._home_flat, weights=flow_LP[:, :P].ravel(),
                                         minlength=L * P).reshape(L, P)
        gpu_LG = np.zeros((L, G + 1))
        gpu_LG[:, :G] = flow_LP[:, :P].reshape(L, G, S).sum(axis=2)
        if self.C and sweeps:
            flow, gpu = flow_LP.reshape(-1), gpu_LG.reshape(-1)
            # Rows are (layer, expert) pairs of one colour; unused entries: dummy slot/GPU, base +inf.
            C, K, X = self.expert_LCK.shape[1], self.expert_LCK.shape[2], self.X
            load_CR = np.take_along_axis(load, self.expert_LCK.reshape(L, -1), axis=1).reshape(
                L, C, K).transpose(1, 0, 2).reshape(C, L * K)
            pad_CRX = np.where(self.use_LCKX, 0.0, np.inf).transpose(1, 0, 2, 3).reshape(C, L * K, X)
            ks = np.arange(1, self.X + 1)
            for _ in range(sweeps):
                for c in range(self.C):
                    s_RX, g_RX = self._slot_C[c], self._gpu_C[c]
                    old_RX = flow[s_RX]
                    # Load of each replica's GPU without this expert.
                    base_RX = gpu[g_RX] - old_RX + pad_CRX[c]
                    b_RX = np.sort(base_RX, axis=1)
                    # Water-filling: the level over the k lowest GPUs is (load + their sum) / k; it
                    # rises over the k lowest while it tops the k-th (+inf entries never count).
                    level_RX = (load_CR[c][:, None] + np.cumsum(b_RX, axis=1)) / ks
                    k_R = (b_RX < level_RX).sum(axis=1)
                    level_R = np.where(k_R > 0, level_RX[np.arange(len(k_R)), np.maximum(k_R - 1, 0)], -np.inf)
                    new_RX = np.maximum(level_R[:, None] - base_RX, 0.0)
                    # Experts of one colour use distinct GPUs, so a fancy-index update is safe (only
                    # the dummy column repeats, and it only ever gets 0).
                    gpu[g_RX] += new_RX - old_RX
                    flow[s_RX] = new_RX
        weights_LP = _shares_to_weights(p, load, flow_LP[:, :P])
        self._last_LP = weights_LP
        return weights_LP
