"""Per-batch dispatch for modeled time: which replicas of an expert take this batch's rows.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots,
C = colours (groups of experts that share no GPU), R = (layer, expert) rows of one colour,
X = most GPUs one expert is on.

An even split sends an expert's n rows to all of its r replicas; in a small decode batch
(n of 1-3) that wakes r replicas, and each streams the expert's weights from HBM: r times the
memory traffic of one. `TimeDispatch(cost)` decides per batch, for every layer at once:
Step 1: experts on one GPU only keep their rows there (nothing to choose).
Step 2: experts on several GPUs (most GPUs first) each pick j of their replicas (1 <= j <= X)
        on the GPUs that are least busy so far (in modeled seconds). With j = 1 all n rows go
        to the least busy one; with j > 1 the rows are water-filled over the j least busy, each
        used replica paying its fixed cost (overhead + weight streaming) and its cost per row.
        The j chosen gives the lowest resulting busiest GPU of the layer; among choices that
        leave the layer's busiest GPU where it is, the one with the least added work (usually
        j = 1: one weight stream).
Step 3: a layer whose busiest GPU the even split would make less busy (in the model), or whose
        modeled step (compute and all-to-all, picks taken as independent) it would make
        shorter, keeps the even split: the rule is never worse than it, layer by layer.
It is the rule of `eplb.dispatch`'s Resplitter done for time instead of tokens: in prefill
(hundreds of rows per expert, compute-bound) it splits hot experts like the token re-split;
in decode it keeps each expert's few rows on one replica. The rule is built with a cost
model, so it is not in `eplb.dispatch.RULES` (whose rules take no arguments):
`TimeDispatch(cost_model("deepseek-v3", "h200"))` is a DispatchRule like the others.
The steps run in numpy, every layer of a colour at once: the rule scores offline traces
(backtest, replay, simulate, calibration), so no compiled twin pays for itself. A batch of 58
layers takes about 0.6 ms (docs/results/time.md, Part 4) because each step touches only what
it changes: Step 2 writes a replica's rows only where they land, Step 3 scores the rule's
split and the even split in one `eplb.dispatch.cost.expected_layer_seconds` call on the
expert time Step 2 has already summed (tests/oracles/timed.py does it all the plain way; the
shares are the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.core.placement import Placement
from eplb.dispatch.cost import CostModel, expected_layer_seconds, first_copy_LP
from eplb.errors import EplbError


@dataclass(frozen=True)
class TimeDispatch:
    """Per-batch shares [L, P] that lower each layer's busiest GPU in modeled time."""

    cost: CostModel
    name = "time"
    per_batch = True

    def bind(self, placement: Placement):
        if not isinstance(self.cost, CostModel):
            raise EplbError(f"TimeDispatch needs a CostModel (eplb.dispatch.cost.cost_model(...)), got "
                            f"{type(self.cost).__name__}")
        if not isinstance(placement, Placement):
            raise EplbError(f"TimeDispatch binds a Placement, got {type(placement).__name__}")
        solver = TimeSolver(placement, self.cost)

        def bound(counts_LE):
            if counts_LE is None:
                raise EplbError("dispatch rule 'time' splits each batch by its own counts: pass counts [L, E]")
            return solver(counts_LE)

        return bound


class TimeSolver:
    """Index tables for one placement, built once; call with a batch's counts [L, E].

    Experts with replicas on >= 2 GPUs are coloured so that experts of one colour share no GPU
    (greedy colouring, most GPUs first): they decide against the layer's busiest GPU as it
    stood when their colour began, so that the order within a colour does not matter. A call
    takes every layer of a colour in one numpy step (per colour the tables are [R, X]: R
    (layer, expert) rows of that colour, X distinct-GPU replicas, padded with a dummy slot P
    and GPU G whose busy time is +inf).
    """

    def __init__(self, placement: Placement, cost: CostModel):
        self.placement, self.cost = placement, cost
        L, P = placement.phy2log_LP.shape
        E, G = placement.num_logical_experts, placement.num_gpus
        gpu_P = placement.gpu_of_slot()
        log2phy_LEX = placement.log2phy_LEX
        X = log2phy_LEX.shape[2]
        gpu_LEX = np.where(log2phy_LEX >= 0, gpu_P[np.maximum(log2phy_LEX, 0)], -1)
        # The first slot of an expert on each GPU it occupies (a second copy on one GPU adds nothing).
        use_LEX = log2phy_LEX >= 0
        for j in range(1, X):
            use_LEX[:, :, j] &= ~(gpu_LEX[:, :, :j] == gpu_LEX[:, :, j:j + 1]).any(axis=2)
        n_gpus_LE = use_LEX.sum(axis=2)
        self.home_LE = log2phy_LEX[:, :, 0]                       # rows of a one-GPU expert go here
        self.multi_LE = n_gpus_LE >= 2
        groups = _colour(self.multi_LE, n_gpus_LE, gpu_LEX, use_LEX, G)
        # The used replicas first (in slot order), so that an expert's n_gpus_LE GPUs are its
        # first columns however many second copies it has.
        front_LEX = np.argsort(~use_LEX, axis=2, kind="stable")
        use_LEX = np.take_along_axis(use_LEX, front_LEX, axis=2)
        gslot_LEX = np.where(use_LEX, np.take_along_axis(log2phy_LEX, front_LEX, axis=2), -1)
        ggpu_LEX = np.where(use_LEX, np.take_along_axis(gpu_LEX, front_LEX, axis=2), -1)
        C = max((len(layer) for layer in groups), default=0)
        K = max((len(c) for layer in groups for c in layer), default=0)
        expert_LCK = np.zeros((L, C, K), dtype=np.int64)
        valid_LCK = np.zeros((L, C, K), dtype=bool)
        for l, layer in enumerate(groups):
            for c, experts in enumerate(layer):
                expert_LCK[l, c, :len(experts)] = experts
                valid_LCK[l, c, :len(experts)] = True
        self._numpy_tables(gslot_LEX, ggpu_LEX, use_LEX, expert_LCK, valid_LCK)
        self.num_colours, self.X = C, X
        # Step 1 and the shares as flat gathers: home slot of every expert, expert of every slot.
        self._home_flat = (np.arange(L)[:, None] * (P + 1) + self.home_LE).ravel()
        home_gpu_flat = (np.arange(L)[:, None] * G + gpu_P[self.home_LE]).ravel()
        self._single_flat = np.flatnonzero(~self.multi_LE.ravel())
        self._single_home, self._single_gpu = self._home_flat[self._single_flat], home_gpu_flat[self._single_flat]
        self._phy_flat = (np.arange(L)[:, None] * E + placement.phy2log_LP).ravel()
        self._even_LP = 1.0 / np.take_along_axis(placement.replica_count_LE, placement.phy2log_LP, axis=1)
        # The even split, for Step 3: replicas of each slot's expert, the slot's rank among them
        # (slot order), and the first copy on the same GPU that its rows are counted with.
        self._count_LP = np.take_along_axis(placement.replica_count_LE, placement.phy2log_LP, axis=1)
        rank_LEX = np.broadcast_to(np.arange(X), log2phy_LEX.shape)
        rank_flat = np.zeros(L * P, dtype=np.int64)
        valid = log2phy_LEX >= 0
        rank_flat[(np.arange(L)[:, None, None] * P + log2phy_LEX)[valid]] = rank_LEX[valid]
        self._rank_LP = rank_flat.reshape(L, P)
        self._first_flat = first_copy_LP(placement).ravel()
        self._second_copies = not np.array_equal(self._first_flat, np.arange(L * P))
        hw = cost.hardware
        self._overhead = hw.expert_overhead_s
        self._stream = cost.weight_bytes / hw.hbm_bytes_per_s
        self._slope_mem = cost.row_bytes / hw.hbm_bytes_per_s
        self._slope_cmp = cost.flops_per_row / hw.flops(cost.expert_dtype)
        self._knee = cost.knee_rows()
        self._ones_S = np.ones(placement.slots_per_gpu)

    def _numpy_tables(self, gslot_LEX, ggpu_LEX, use_LEX, expert_LCK, valid_LCK) -> None:
        """Per colour, only its real rows: flat indices into the [L, E] counts, the [L, P + 1]
        rows and [L, G + 1] busy-time buffers (padded with slot P and GPU G), and the layer of
        each row."""
        L, C, _ = expert_LCK.shape
        P, G, E = self.placement.num_slots, self.placement.num_gpus, self.placement.num_logical_experts
        r4, e4 = np.arange(L)[:, None, None, None], expert_LCK[:, :, :, None]
        use_LCKX = use_LEX[r4, e4, np.arange(use_LEX.shape[2])] & valid_LCK[:, :, :, None]
        slot_LCKX = np.where(use_LCKX, gslot_LEX[r4, e4, np.arange(use_LEX.shape[2])], P)
        gpu_LCKX = np.where(use_LCKX, ggpu_LEX[r4, e4, np.arange(use_LEX.shape[2])], G)
        layer_LCK = np.broadcast_to(np.arange(L)[:, None, None], expert_LCK.shape)
        self._colours = []
        for c in range(C):
            ok = valid_LCK[:, c]
            lay = layer_LCK[:, c][ok]
            width = max(int(use_LCKX[:, c][ok].sum(axis=1).max()), 1)  # most GPUs of this colour's experts
            self._colours.append((lay * E + expert_LCK[:, c][ok],
                                  (lay * (P + 1))[:, None] + slot_LCKX[:, c][ok][:, :width],
                                  (lay * (G + 1))[:, None] + gpu_LCKX[:, c][ok][:, :width], lay))
        self._ks = [np.arange(1, c[1].shape[1] + 1, dtype=np.float64) for c in self._colours]

    def _seconds(self, n):
        """cost.replica_seconds without its checks (the roofline of one replica)."""
        busy = n * self._slope_mem                                  # in place: this runs ~15 times a batch
        busy += self._stream
        np.maximum(busy, n * self._slope_cmp, out=busy)
        busy += self._overhead
        busy *= n > 0
        return busy

    def _checked(self, counts_LE) -> np.ndarray:
        p = self.placement
        L, E = p.num_layers, p.num_logical_experts
        counts = np.ascontiguousarray(counts_LE, dtype=np.float64)
        if counts.shape != (L, E):
            raise EplbError(f"counts have shape {counts.shape}, but the placement needs {(L, E)} "
                            f"[layers, logical experts]")
        if not np.all(np.isfinite(counts)) or (counts.size and counts.min() < 0):
            raise EplbError("counts must be finite and non-negative")
        return counts

    def _tokens(self, counts: np.ndarray) -> int:
        """Tokens of the batch, from the first layer's rows (each token takes top-k of them)."""
        return int(round(counts[0].sum() / self.cost.model.top_k)) if len(counts) else 0

    def __call__(self, counts_LE) -> np.ndarray:
        """Shares [L, P] (per expert they sum to 1) for this batch's counts [L, E], colour by
        colour over every layer at once, Step 3 through `eplb.dispatch.cost.expected_layer_seconds`."""
        p = self.placement
        L, P = p.phy2log_LP.shape
        G = p.num_gpus
        counts = self._checked(counts_LE)
        whole = bool(np.array_equal(counts, np.floor(counts)))
        flat_counts = counts.reshape(-1)
        # Step 1: experts on one GPU keep their rows there (one home slot each: no two share one).
        n_single = flat_counts[self._single_flat]
        rows = np.zeros(L * (P + 1))
        rows[self._single_home] = n_single
        busy = np.full((L, G + 1), np.inf)
        busy[:, :G] = np.bincount(self._single_gpu, weights=self._seconds(n_single), minlength=L * G).reshape(L, G)
        busy = busy.reshape(-1)
        # Step 2: one colour at a time, every layer at once.
        with np.errstate(invalid="ignore"):                         # padding replicas are +inf busy
            for colour, ks in zip(self._colours, self._ks):
                self._colour_step(colour, ks, flat_counts, rows, busy, whole)
        count_LP = flat_counts[self._phy_flat].reshape(L, P)
        rows_LP = rows.reshape(L, P + 1)[:, :P]
        shares_LP = np.divide(rows_LP, count_LP, out=self._even_LP.copy(), where=count_LP > 0)
        # Step 3: keep the even split in layers where it is modeled faster (a greedy choice can
        # lose to it between the regimes), so the rule is never worse than the even split.
        even_LP = self._even_rows(count_LP, whole)
        even_LG = self._seconds(even_LP).reshape(L, G, -1) @ self._ones_S   # BLAS: fast over a short axis
        busy_LG = busy.reshape(L, G + 1)[:, :G]
        worse_L = busy_LG.max(axis=1) > even_LG.max(axis=1) * (1 + 1e-12)
        # Rows gathered on fewer replicas also gather the all-to-all onto fewer GPUs: a layer
        # whose modeled step (expert compute and all-to-all, picks taken as independent) is
        # slower than the even split's keeps the even split too. Both splits in one call.
        layer_L = expected_layer_seconds(self.cost, p, np.concatenate([rows_LP, even_LP]), self._tokens(counts),
                                         np.concatenate([busy_LG, even_LG]))
        worse_L |= layer_L[:L] > layer_L[L:] * (1 + 1e-12)
        shares_LP[worse_L] = self._even_LP[worse_L]
        return shares_LP

    def _colour_step(self, colour, ks, flat_counts, rows, busy, whole: bool) -> None:
        """Step 2 for the experts of one colour, every layer at once: their rows into `rows`
        (flat [L, P + 1]) and their modeled seconds onto `busy` (flat [L, G + 1]), in place."""
        count_R, slot_RX, gpu_RX, layer_R = colour
        L, G = self.placement.num_layers, self.placement.num_gpus
        n_R = flat_counts[count_R]
        base_RX = busy[gpu_RX]
        ar_R = np.arange(len(n_R))
        # All rows on the least busy replica is the least work; where that leaves the layer's
        # busiest GPU as it is, it is the choice, and nothing needs sorting.
        first_R = base_RX.argmin(axis=1)
        one_R = self._seconds(n_R)
        layer_max_R = busy.reshape(L, G + 1)[:, :G].max(axis=1)[layer_R]
        hard_R = base_RX[ar_R, first_R] + one_R > layer_max_R
        # Each slot belongs to one expert, seen once, so its rows are set, not added. Experts of
        # one colour use distinct GPUs: the fancy-index updates do not collide (only the padding
        # slot and GPU repeat, and they only ever get 0).
        rows[slot_RX[ar_R, first_R]] = n_R
        easy = ~hard_R
        busy[gpu_RX[ar_R[easy], first_R[easy]]] += one_R[easy]
        hard = np.flatnonzero(hard_R)
        if hard.size:
            sub_RX = base_RX[hard]
            order_RX = np.argsort(sub_RX, axis=1, kind="stable")
            ar = np.arange(hard.size)[:, None]
            amount_RX = np.empty_like(sub_RX)
            amount_RX[ar, order_RX] = self._options(n_R[hard], sub_RX[ar, order_RX], layer_max_R[hard], whole, ks)
            rows[slot_RX[hard]] = amount_RX
            busy[gpu_RX[hard]] += self._seconds(amount_RX)

    def _even_rows(self, count_LP: np.ndarray, whole: bool) -> np.ndarray:
        """Rows of every slot under the even split (whole rows round-robin in slot order, as
        `eplb.dispatch.cost.slot_rows` deals them), copies on one GPU counted with the first, [L, P]."""
        if whole:
            # The replica of rank k takes the rows k, k + r, k + 2r, ... of the expert's n.
            rows_LP = count_LP - self._rank_LP
            rows_LP /= self._count_LP
            np.ceil(rows_LP, out=rows_LP)
            np.maximum(rows_LP, 0.0, out=rows_LP)
        else:
            rows_LP = count_LP / self._count_LP
        if not self._second_copies:
            return rows_LP
        L, P = rows_LP.shape
        return np.bincount(self._first_flat, weights=rows_LP.ravel(), minlength=L * P).reshape(L, P)

    def _options(self, n_R, b_RX, layer_max_R, whole: bool, ks) -> np.ndarray:
        """Rows for each of the X least busy replicas (sorted by busy time), [R, X]."""
        R, X = b_RX.shape
        ar = np.arange(R)
        # j >= 2: water-fill over the j least busy with cost fixed + slope x rows per replica,
        # in the regime its rows per replica fall in (compute-bound: no streaming term).
        compute_RX = n_R[:, None] / ks >= self._knee
        fixed_RX = np.where(compute_RX, self._overhead, self._overhead + self._stream)
        slope_RX = np.where(compute_RX, self._slope_cmp, self._slope_mem)
        level_RX = (n_R[:, None] * slope_RX + np.cumsum(b_RX + fixed_RX, axis=1)) / ks
        touched_RX = np.where(level_RX >= b_RX + fixed_RX, level_RX, np.inf)
        work_RX = ks * fixed_RX + n_R[:, None] * slope_RX
        # j = 1: exactly the roofline of all n rows on the least busy replica.
        one_R = self._seconds(n_R)
        touched_RX[:, 0] = b_RX[:, 0] + one_R
        work_RX[:, 0] = one_R
        # Lowest busiest GPU first; ties (under the layer's busiest) go to the least work.
        j_R = (np.maximum(touched_RX, layer_max_R[:, None]) + 1e-9 * work_RX).argmin(axis=1)
        if not j_R.any():                                          # every expert on one replica (decode)
            amount_RX = np.zeros_like(b_RX)
            amount_RX[:, 0] = n_R
            return amount_RX
        level_R, fixed_R, slope_R = level_RX[ar, j_R], fixed_RX[ar, j_R], slope_RX[ar, j_R]
        used_RX = np.arange(X)[None, :] <= j_R[:, None]
        amount_RX = np.where(used_RX, np.maximum((level_R - fixed_R)[:, None] - b_RX, 0.0) / slope_R[:, None], 0.0)
        amount_RX = np.where(used_RX & (j_R[:, None] > 0), amount_RX, 0.0)
        if whole:
            amount_RX = np.floor(amount_RX + 1e-9)
        amount_RX[:, 0] += n_R - amount_RX.sum(axis=1)             # j = 1, and rounding of the level
        return amount_RX


def _colour(multi_LE, n_gpus_LE, gpu_LEX, use_LEX, num_gpus: int) -> list[list[list[int]]]:
    """groups[l][c]: experts of colour c in layer l; experts of one colour share no GPU."""
    groups = []
    for l in range(multi_LE.shape[0]):
        multi = np.flatnonzero(multi_LE[l])
        multi = multi[np.argsort(-n_gpus_LE[l, multi], kind="stable")]
        taken_G: list[set[int]] = [set() for _ in range(num_gpus)]
        layer: list[list[int]] = []
        for e in multi:
            gpus = gpu_LEX[l, e][use_LEX[l, e]]
            taken = set().union(*(taken_G[g] for g in gpus))
            c = next(c for c in range(len(layer) + 1) if c not in taken)
            if c == len(layer):
                layer.append([])
            layer[c].append(int(e))
            for g in gpus:
                taken_G[g].add(c)
        groups.append(layer)
    return groups

