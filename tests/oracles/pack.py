"""greedy's packing (planners/_pack_kernel.py `pack`) in plain Python, one row at a time.

Longest-processing-time with a slot limit: replicas in order (heaviest first, ties by expert
id), each to the lightest GPU (ties: lower index) with a free slot that does not hold its
expert; None where some replica finds no such GPU. `rounds` is the fallback the kernel packs
such a row with: S rounds of G, round k's replicas to the GPUs in load order, the expert that
opens a round and sits on a GPU already taking the lightest GPUs without it.
"""

from __future__ import annotations


def replicas(per_E, count_E) -> list[int]:
    """Each expert's replicas, by load per replica descending, ties by id."""
    experts = sorted(range(len(per_E)), key=lambda e: (-per_E[e], e))
    return [e for e in experts for _ in range(int(count_E[e]))]


def lpt(per_E, count_E, G: int, S: int) -> list[int] | None:
    """phy2log [P] of one row by LPT, or None where a replica finds no open GPU without its expert."""
    phy = [-1] * (G * S)
    load = [0.0] * G
    fill = [0] * G
    for e in replicas(per_E, count_E):
        open_ = [g for g in range(G) if fill[g] < S and e not in phy[g * S:g * S + fill[g]]]
        if not open_:
            return None
        g = min(open_, key=lambda g: (load[g], g))
        phy[g * S + fill[g]] = e
        fill[g] += 1
        load[g] += per_E[e]
    return phy


def rounds(per_E, count_E, G: int, S: int) -> list[int]:
    """phy2log [P] of one row in S rounds (slot k of every GPU in round k)."""
    rep = replicas(per_E, count_E)
    phy = [-1] * (G * S)
    load = [0.0] * G
    for k in range(S):
        order = sorted(range(G), key=lambda g: (load[g], g))
        items = rep[k * G:(k + 1) * G]
        if k > 0 and items[0] in [phy[g * S + k - 1] for g in range(G)]:
            m = sum(1 for e in items if e == items[0])
            chosen = [g for g in order if phy[g * S + k - 1] != items[0]][:m]
            order = chosen + [g for g in order if g not in chosen]
        for g, e in zip(order, items):
            phy[g * S + k] = e
            load[g] += per_E[e]
    return phy
