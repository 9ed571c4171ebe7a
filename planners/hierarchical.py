"""Node-aware planner: each expert group's replicas on as few nodes as balance allows.

Legend: L = MoE layers, E = logical experts, K = expert groups, N = nodes, G = GPUs,
S = slots per GPU, P = G x S slots, C = P / N slots per node, Q = G / N GPUs per node.

Why: with group-limited routing (DeepSeek-V3 sends a token to <= 4 of 8 groups), a token's
experts sit on few nodes when each group's experts share a node, so less traffic crosses
the slow inter-node links. DeepSeek's hierarchical policy gets that by packing whole groups
onto nodes and replicating inside each node, which raises the busiest GPU (a node's redundant
slots can only serve its own groups; benchmarks/bench_greedy.py measures by how much). Here
balance comes first and locality second:

Step 1: replicate globally, exactly as `greedy` does (a hot expert may have replicas on any
        node, so no node's redundant slots are wasted on its own cold experts).
Step 2: cut groups into nodes. Groups are laid out in one sequence whose running
        (slots, load) stays close to the diagonal (C slots per T = total / N of load), and the
        sequence is cut every C slots; the group a cut falls in is split, and which of its
        replicas go left is chosen so the node's load lands on T. Most groups end up whole
        on one node, about N - 1 groups on two.
Step 3: even out node loads by swapping replicas between the busiest and the idlest node,
        preferring swaps that put no group on a new node.
Step 4: pack each node's replicas onto its own GPUs (greedy's heaviest-first packing), then
        swap replicas between GPUs of the same node to lower the busiest one.
Step 5: guard: any layer whose busiest GPU is more than `tolerance` above greedy's gets
        cross-node swaps (greedy's refine), and if that is still not enough, greedy's layer.
        Both are counted in Solution.info and the message; nothing is replaced silently.

Groups: `request.num_expert_groups` contiguous groups of E / K experts (DeepSeek-V3: 8 groups of
32). Without groups (None) every expert is its own group (its replicas are kept on few
nodes). E not divisible by K is refused. K need not divide by N; G must (Topology checks).
"""

from __future__ import annotations

import numpy as np

from eplb.core.placement import gpu_loads
from eplb.errors import EplbError, fraction, whole_number
from eplb.stats.loads import group_span
from planners.api import PlanRequest, Solution
from planners.greedy import pack, pack_replicas, refine, replicate


def _order_groups(rep_K: np.ndarray, load_K: np.ndarray, C: int, T: float) -> list[int]:
    """Group order whose running (slots / C, load / T) stays closest to the diagonal."""
    left = list(range(len(rep_K)))
    order: list[int] = []
    c = w = 0.0
    while left:
        gap = [abs((c + rep_K[k]) / C - (w + load_K[k]) / T) for k in left]
        k = left[int(np.argmin(gap))]
        order.append(k)
        left.remove(k)
        c += rep_K[k]
        w += load_K[k]
    return order


def _choose(avail_E: np.ndarray, w_E: np.ndarray, m: int, x: float) -> np.ndarray:
    """Pick m replicas from avail_E (counts) with total load close to x; returns counts [E]."""
    take_E = np.zeros_like(avail_E)
    left_E = avail_E.copy()
    rest = x
    for k in range(m, 0, -1):
        # The replica closest to the average still needed keeps the remaining choice flexible.
        cand = np.flatnonzero(left_E > 0)
        e = cand[np.argmin(np.abs(w_E[cand] - rest / k))]
        take_E[e] += 1
        left_E[e] -= 1
        rest -= w_E[e]
    for _ in range(8):  # a few best single exchanges between taken and left replicas
        ins, outs = np.flatnonzero(take_E > 0), np.flatnonzero(left_E > 0)
        if not len(ins) or not len(outs):
            break
        new_err = np.abs(rest + w_E[ins][:, None] - w_E[outs][None, :])
        i, o = np.unravel_index(np.argmin(new_err), new_err.shape)
        if new_err[i, o] >= abs(rest) * (1 - 1e-12):
            break
        rest += w_E[ins[i]] - w_E[outs[o]]
        take_E[ins[i]] -= 1
        left_E[ins[i]] += 1
        take_E[outs[o]] += 1
        left_E[outs[o]] -= 1
    return take_E


def _cut(w_E: np.ndarray, r_E: np.ndarray, group_E: np.ndarray, K: int, N: int, C: int, Q: int) -> np.ndarray:
    """Step 2 for one layer: replicas of each expert on each node, int [N, E].

    Walks the group sequence, filling each node's C slots in turn; the group a node boundary
    falls in is split, the part kept chosen to bring the node's load to its share T.
    (A node may still end far from T when a group is much denser, in load per slot, than
    the rest: step 3 then moves part of it.)
    """
    E = len(w_E)
    load_E = w_E * r_E
    T = load_E.sum() / N
    rep_K = np.bincount(group_E, weights=r_E, minlength=K)
    load_K = np.bincount(group_E, weights=load_E, minlength=K)
    cnt_NE = np.zeros((N, E), dtype=np.int64)
    node, room, done = 0, C, 0.0
    chunks = [np.where(group_E == k, r_E, 0).astype(np.int64) for k in _order_groups(rep_K, load_K, C, max(T, 1e-300))]
    deferred_E = np.zeros(E, dtype=np.int64)  # replicas a node could not take (one per GPU)
    while chunks:
        rem_E = chunks.pop(0)
        while rem_E.sum():
            if node == N - 1:
                cnt_NE[node] += rem_E + deferred_E  # the last node takes the rest: C slots
                done += float((rem_E + deferred_E) @ w_E)
                rem_E, deferred_E = 0 * rem_E, 0 * deferred_E
                break
            fit_E = np.minimum(rem_E, Q - cnt_NE[node])  # at most one replica per GPU of the node
            if rem_E.sum() <= room and np.array_equal(fit_E, rem_E):
                take_E = rem_E.copy()
            else:
                m = int(min(room, fit_E.sum()))
                take_E = _choose(fit_E, w_E, m, (node + 1) * T - done) if m else np.zeros_like(rem_E)
            cnt_NE[node] += take_E
            rem_E -= take_E
            room -= int(take_E.sum())
            done += float(take_E @ w_E)
            if room == 0:
                node, room = node + 1, C
                if deferred_E.sum():  # replicas held back by the per-GPU limit open the new node
                    chunks.insert(0, deferred_E)
                    deferred_E = np.zeros(E, dtype=np.int64)
            elif rem_E.sum():
                deferred_E += rem_E
                rem_E = 0 * rem_E
    if deferred_E.sum():
        cnt_NE[N - 1] += deferred_E
    if (cnt_NE.sum(axis=1) != C).any():
        # The groups ran out while a node still had room that its per-GPU limit kept it from
        # filling with what was left; the last node then took more than C slots.
        _fill_nodes(cnt_NE, C, Q)
    return cnt_NE


def _fill_nodes(cnt_NE: np.ndarray, C: int, Q: int) -> None:
    """Move replicas (in place) until every node holds exactly C, never adding an expert to a
    node that already holds Q of it (per-node overflows beyond Q are left to `_even_out`).

    Each move follows a path from a node above C to one below it: node u hands one replica of
    an expert to node v where v has room for it (an augmenting path; one always exists while
    some node is above C, because every expert has at most N x Q replicas)."""
    N, E = cnt_NE.shape
    while True:
        sum_N = cnt_NE.sum(axis=1)
        over = [int(a) for a in np.flatnonzero(sum_N > C)]
        if not over:
            return
        # Breadth-first search over nodes; parent[v] = (u, e): move expert e from u to v.
        parent: dict[int, tuple[int, int] | None] = {a: None for a in over}
        queue, end = list(over), None
        while queue and end is None:
            u = queue.pop(0)
            for v in range(N):
                if v in parent:
                    continue
                movable = np.flatnonzero((cnt_NE[u] > 0) & (cnt_NE[v] < Q))
                if not len(movable):
                    continue
                # The expert u holds most of (an overflow first) keeps groups least spread.
                parent[v] = (u, int(movable[np.argmax(cnt_NE[u, movable])]))
                if sum_N[v] < C:
                    end = v
                    break
                queue.append(v)
        assert end is not None, "no augmenting path between nodes (an expert has more than N x Q replicas)"
        v = end
        while parent[v] is not None:
            u, e = parent[v]
            cnt_NE[u, e] -= 1
            cnt_NE[v, e] += 1
            v = u


def _even_out(cnt_NE: np.ndarray, w_E: np.ndarray, group_E: np.ndarray, K: int, Q: int,
              rel_tol: float = 1e-4, max_swaps: int = 200) -> None:
    """Step 3 for one layer (in place): swap replicas between nodes to even out node loads.

    Also repairs any node holding more than Q replicas of one expert (possible only for
    experts with more than Q replicas).
    """
    N, E = cnt_NE.shape
    T = float(cnt_NE.sum(axis=0) @ w_E) / N
    for _ in range(max_swaps):
        load_N = cnt_NE @ w_E
        over = np.argwhere(cnt_NE > Q)
        if len(over):
            a, e_fix = over[0]
            b = int(np.argmin(np.where(cnt_NE[:, e_fix] < Q, load_N, np.inf)))
            need, mask_e = 0.0, np.arange(E) == e_fix
        else:
            a, b = int(np.argmax(load_N)), int(np.argmin(load_N))
            need = min(load_N[a] - T, T - load_N[b])
            if load_N[a] - T <= rel_tol * T or need <= 0:
                return
            mask_e = cnt_NE[a] > 0
        # Swap e (node a -> b) with f (node b -> a); delta = load moved from a to b.
        e_I = np.flatnonzero(mask_e & (cnt_NE[b] < Q))
        f_J = np.flatnonzero((cnt_NE[b] > 0) & (cnt_NE[a] < Q))
        if not len(e_I) or not len(f_J):
            return
        delta_IJ = w_E[e_I][:, None] - w_E[f_J][None, :]
        ok_IJ = e_I[:, None] != f_J[None, :]
        gc_NK = np.zeros((N, K), dtype=np.int64)
        np.add.at(gc_NK, (np.repeat(np.arange(N), E), np.tile(group_E, N)), cnt_NE.ravel())
        ge, gf = group_E[e_I][:, None], group_E[f_J][None, :]
        # Change in the number of (group, node) pairs: the locality cost of the swap.
        dspan_IJ = np.where(ge == gf, 0, (gc_NK[b, ge] == 0).astype(int) + (gc_NK[a, gf] == 0)
                            - (gc_NK[a, ge] == 1) - (gc_NK[b, gf] == 1))
        if len(over):
            err_IJ = np.abs(delta_IJ)  # any swap fixes the cap; keep loads where they are
            useful_IJ = ok_IJ
        else:
            err_IJ = np.abs(delta_IJ - need)
            useful_IJ = ok_IJ & (delta_IJ > 0) & (delta_IJ < 2 * need)
            if not useful_IJ.any():
                return
        # Prefer swaps that halve the gap, least locality cost first; else the best fit.
        good_IJ = useful_IJ & (err_IJ <= 0.5 * max(need, 0.0)) if not len(over) else useful_IJ
        pool_IJ = good_IJ if good_IJ.any() else useful_IJ
        score_IJ = np.where(pool_IJ, dspan_IJ * (4 * T + 1) + err_IJ, np.inf)
        i, j = np.unravel_index(np.argmin(score_IJ), score_IJ.shape)
        e, f = e_I[i], f_J[j]
        cnt_NE[a, e] -= 1
        cnt_NE[b, e] += 1
        cnt_NE[b, f] -= 1
        cnt_NE[a, f] += 1


def _max_gpu(phy2log_LP: np.ndarray, per_LE: np.ndarray, G: int) -> np.ndarray:
    """Busiest GPU per layer, [L], when every replica of expert e carries per_LE[l, e]."""
    return gpu_loads(phy2log_LP, per_LE, G, 1.0).max(axis=1)


class HierarchicalPlanner:
    """Group-local (node-aware) placement with greedy-level balance.

    tolerance: a layer's busiest GPU may exceed greedy's by at most this fraction (default
    0.005); layers beyond it are repaired by cross-node swaps, else planned by greedy.
    refine_rounds: intra-node swap rounds after packing (default 16).
    node_tolerance: how far above its share (total / N) a node's load may stay after step 3
    (default 0.001); looser keeps groups more local, tighter leaves the GPUs less to absorb.
    """

    name = "hierarchical"

    def __init__(self, tolerance: float = 0.005, refine_rounds: int = 16, node_tolerance: float = 1e-3):
        # float() first: a setting given as text (--set tolerance=x) is "of the wrong type" (get_planner).
        self.tolerance = fraction("tolerance", float(tolerance), low_open=False, high_open=True)
        self.node_tolerance = fraction("node_tolerance", float(node_tolerance), low_open=False, high_open=True)
        self.refine_rounds = whole_number("refine_rounds", refine_rounds)

    def plan(self, request: PlanRequest) -> Solution:
        t = request.topology
        load_LE = np.asarray(request.load_LE, dtype=np.float64)
        L, E = load_LE.shape
        G, S, N = t.num_gpus, t.slots_per_gpu, t.num_nodes
        P, Q = G * S, t.gpus_per_node
        C = P // N
        if P < E:
            raise EplbError(f"{G} GPUs x {S} slots = {P} slots cannot hold {E} experts")
        if P > G * E:
            raise EplbError(f"{P} slots need more than one replica of an expert per GPU ({E} experts, {G} GPUs)")
        K = E if request.num_expert_groups is None else int(request.num_expert_groups)
        if K < 1 or E % K:
            raise EplbError(
                f"{E} experts do not split into {K} equal expert groups: group-limited routing "
                f"uses equal contiguous groups, so give num_expert_groups (--expert-groups) dividing {E}"
            )
        group_E = np.arange(E) // (E // K)

        # Step 1: replicate globally (greedy's counts) and greedy's own (refined) plan as the yardstick.
        count_LE = replicate(load_LE, P, G)
        per_LE = load_LE / count_LE
        greedy_LP = refine(pack(load_LE, count_LE, G, S), None, None, G, per_LE=per_LE)
        greedy_max_L = _max_gpu(greedy_LP, per_LE, G)

        # Steps 2-3: replicas of each expert on each node, layer by layer.
        cnt_LNE = np.empty((L, N, E), dtype=np.int64)
        for layer in range(L):
            cnt = _cut(per_LE[layer], count_LE[layer], group_E, K, N, C, Q)
            _even_out(cnt, per_LE[layer], group_E, K, Q, self.node_tolerance)
            cnt_LNE[layer] = cnt
        assert (cnt_LNE.sum(axis=2) == C).all() and (cnt_LNE <= Q).all()

        # Step 4: pack each node onto its own GPUs; rows are (layer, node).
        per_XE = np.repeat(per_LE, N, axis=0)
        phy2log_XC = pack_replicas(per_XE, cnt_LNE.reshape(L * N, E), Q, S)
        if self.refine_rounds:
            refine(phy2log_XC, None, None, Q, self.refine_rounds, per_LE=per_XE)
        phy2log_LP = phy2log_XC.reshape(L, P)

        # Step 5: guard the balance against greedy's, layer by layer.
        limit_L = greedy_max_L * (1 + self.tolerance) + 1e-12
        bad = np.flatnonzero(_max_gpu(phy2log_LP, per_LE, G) > limit_L)
        repaired = from_greedy = 0
        if len(bad):
            sub = phy2log_LP[bad].copy()
            refine(sub, None, None, G, per_LE=per_LE[bad])
            ok = _max_gpu(sub, per_LE[bad], G) <= limit_L[bad]
            phy2log_LP[bad[ok]] = sub[ok]
            phy2log_LP[bad[~ok]] = greedy_LP[bad[~ok]]
            repaired, from_greedy = int(ok.sum()), int((~ok).sum())

        span_LK = group_span(phy2log_LP, t, K, E)
        greedy_span_LK = group_span(greedy_LP, t, K, E)
        info = {
            "num_groups": K,
            "groups_given": request.num_expert_groups is not None,
            "group_span_mean": float(span_LK.mean()),
            "group_span_max": int(span_LK.max()),
            "greedy_group_span_mean": float(greedy_span_LK.mean()),
            "max_gpu_vs_greedy_max": float((_max_gpu(phy2log_LP, per_LE, G)
                                            / np.maximum(greedy_max_L, 1e-300)).max()),
            "layers_repaired_cross_node": repaired,
            "layers_from_greedy": from_greedy,
        }
        msg = (f"groups span {info['group_span_mean']:.2f} nodes on average "
               f"(greedy: {info['greedy_group_span_mean']:.2f})")
        if request.num_expert_groups is None:
            msg += "; no expert groups given, so each expert is its own group"
        if repaired or from_greedy:
            msg += (f"; {repaired} layer(s) needed cross-node swaps and {from_greedy} use greedy's "
                    f"placement to stay within {self.tolerance:.1%} of greedy's balance")
        return Solution(phy2log_LP, message=msg, info=info)
