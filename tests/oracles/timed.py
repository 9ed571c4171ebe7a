"""The time dispatch's per-batch steps written the plain way, kept as a test oracle.

Legend: L = MoE layers, E = logical experts, G = GPUs, P = physical slots, R = (layer, expert)
rows of one colour, X = most GPUs one expert is on.

`ReferenceTimeSolver` shares `eplb.dispatch.timed.TimeSolver`'s index tables and its water-fill
(`_options`) but does each batch the obvious way: Step 1 over every expert (zero rows for the
multi-GPU ones), Step 2 updating whole [R, X] tables per colour, and Step 3 through two full
`eplb.dispatch.cost.step_cost` calls. TimeSolver sets only what changes, sums with BLAS and
scores both splits in one call; the shares it gives are these.
"""

from __future__ import annotations

import numpy as np

from eplb.dispatch.cost import step_cost
from eplb.dispatch.timed import TimeSolver


class ReferenceTimeSolver(TimeSolver):
    def _seconds_ref(self, n):
        busy = self._overhead + np.maximum(n * self._slope_cmp, self._stream + n * self._slope_mem)
        return np.where(n > 0, busy, 0.0)

    def _even_rows_ref(self, count_LP, whole):
        if whole:
            base_LP = np.floor(count_LP / self._count_LP)
            rows_LP = base_LP + (self._rank_LP < count_LP - base_LP * self._count_LP)
        else:
            rows_LP = count_LP / self._count_LP
        L, P = rows_LP.shape
        return np.bincount(self._first_flat, weights=rows_LP.ravel(), minlength=L * P).reshape(L, P)

    def __call__(self, counts_LE) -> np.ndarray:
        p = self.placement
        L, P = p.phy2log_LP.shape
        G = p.num_gpus
        counts = self._checked(counts_LE)
        whole = bool(np.array_equal(counts, np.floor(counts)))
        flat_counts = counts.reshape(-1)
        home_gpu_flat = (np.arange(L)[:, None] * G + p.gpu_of_slot()[self.home_LE]).ravel()
        # Step 1: experts on one GPU keep their rows there.
        fixed = np.where(self.multi_LE.reshape(-1), 0.0, flat_counts)
        rows = np.bincount(self._home_flat, weights=fixed, minlength=L * (P + 1))
        busy = np.full((L, G + 1), np.inf)
        busy[:, :G] = np.bincount(home_gpu_flat, weights=self._seconds_ref(fixed), minlength=L * G).reshape(L, G)
        busy = busy.reshape(-1)
        # Step 2: one colour at a time, every layer at once.
        with np.errstate(invalid="ignore"):
            for (count_R, slot_RX, gpu_RX, layer_R), ks in zip(self._colours, self._ks):
                n_R = flat_counts[count_R]
                base_RX = busy[gpu_RX]
                R = len(n_R)
                first_R = base_RX.argmin(axis=1)
                one_R = self._seconds_ref(n_R)
                layer_max_R = busy.reshape(L, G + 1)[:, :G].max(axis=1)[layer_R]
                hard = np.flatnonzero(base_RX[np.arange(R), first_R] + one_R > layer_max_R)
                take_RX = np.zeros_like(base_RX)
                take_RX[np.arange(R), first_R] = n_R
                if hard.size:
                    sub_RX = base_RX[hard]
                    order_RX = np.argsort(sub_RX, axis=1, kind="stable")
                    ar = np.arange(hard.size)[:, None]
                    amount_RX = np.empty_like(sub_RX)
                    amount_RX[ar, order_RX] = self._options(n_R[hard], sub_RX[ar, order_RX], layer_max_R[hard],
                                                            whole, ks)
                    take_RX[hard] = amount_RX
                rows[slot_RX] += take_RX
                busy[gpu_RX] += self._seconds_ref(take_RX)
        count_LP = flat_counts[self._phy_flat].reshape(L, P)
        rows_LP = rows.reshape(L, P + 1)[:, :P]
        shares_LP = np.where(count_LP > 0, rows_LP / np.where(count_LP > 0, count_LP, 1.0), self._even_LP)
        # Step 3: keep the even split where it is modeled faster, in expert time or in the step.
        even_LP = self._even_rows_ref(count_LP, whole)
        even_LG = self._seconds_ref(even_LP).reshape(L, G, -1).sum(axis=2)
        worse_L = busy.reshape(L, G + 1)[:, :G].max(axis=1) > even_LG.max(axis=1) * (1 + 1e-12)
        tokens = self._tokens(counts)
        worse_L |= (step_cost(self.cost, p, rows_LP, tokens).layer_s_L
                    > step_cost(self.cost, p, even_LP, tokens).layer_s_L * (1 + 1e-12))
        return np.where(worse_L[:, None], self._even_LP, shares_LP)
