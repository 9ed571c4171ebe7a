"""Compiled draws of SGLang's `static` dispatch (numba): `eplb.dispatch.sglang._fair_choices`
run over many candidate lists from one seeded `random.Random`, to the same picks.

Legend: J = candidate lists drawn for, in draw order; X = the longest list; K = picks in all.

SGLang draws with Python's `random.Random(42)`: per list, `rng.sample(arr, remainder)` then
`rng.shuffle(ans)`. Both come down to `Random._randbelow(n)`: `getrandbits(n.bit_length())`,
drawn again while >= n, where getrandbits(k <= 32) is the Mersenne Twister's next 32-bit word
shifted right by 32 - k. This module is that algorithm (MT19937 as CPython's _randommodule.c
has it; sample's pool and set branches and shuffle as Lib/random.py has them), started from
the state `random.Random(seed).getstate()` gives, so Python does the seeding. `warm_up` checks
the kernel against Python's own draws on lists of every shape the rule makes and sets `ready`
only when every pick agrees (another Python's random would keep the draws in Python).
"""

from __future__ import annotations

import random

import numpy as np
from numba import njit

ready = False
"""True once `warm_up` has loaded the kernel and found its draws equal to Python's
(eplb.dispatch.sglang draws with it from then on)."""

_N = 624
_M = 397


@njit(cache=True, nogil=True)
def _next(mt, pos):
    """The next 32-bit output of the generator (state mt, int64 [624]; pos: int64 [1], the index)."""
    if pos[0] >= _N:
        for kk in range(_N - _M):
            y = (mt[kk] & 0x80000000) | (mt[kk + 1] & 0x7FFFFFFF)
            mt[kk] = mt[kk + _M] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
        for kk in range(_N - _M, _N - 1):
            y = (mt[kk] & 0x80000000) | (mt[kk + 1] & 0x7FFFFFFF)
            mt[kk] = mt[kk + _M - _N] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
        y = (mt[_N - 1] & 0x80000000) | (mt[0] & 0x7FFFFFFF)
        mt[_N - 1] = mt[_M - 1] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
        pos[0] = 0
    y = mt[pos[0]]
    pos[0] += 1
    y ^= y >> 11
    y ^= (y << 7) & 0x9D2C5680
    y ^= (y << 15) & 0xEFC60000
    y ^= y >> 18
    return y


@njit(cache=True, nogil=True)
def _randbelow(n, mt, pos):
    """Random._randbelow_with_getrandbits(n), n in 1 .. 2**32 - 1."""
    k = 0
    while (n >> k) > 0:
        k += 1
    r = _next(mt, pos) >> (32 - k)
    while r >= n:
        r = _next(mt, pos) >> (32 - k)
    return r


@njit(cache=True, nogil=True)
def fair_draws(state, slots_JX, count_J, k_J, out_K):
    """Every list's `_fair_choices(slots_JX[j, :count_J[j]], k_J[j], rng)` into out_K (int64,
    the lists' picks one after another), from one generator started at `state` (int64 [625]:
    `random.Random(seed).getstate()[1]`, the words then the index). Returns the picks written."""
    mt = state[:_N].copy()
    pos = state[_N:].copy()
    X = slots_JX.shape[1]
    pool = np.empty(X, dtype=np.int64)
    taken = np.zeros(X, dtype=np.bool_)
    o = 0
    for j in range(slots_JX.shape[0]):
        n = count_J[j]
        k = k_J[j]
        quotient = k // n
        remainder = k - quotient * n
        for q in range(quotient):
            for x in range(n):
                out_K[o + q * n + x] = slots_JX[j, x]
        at = o + quotient * n
        # rng.sample(arr, remainder): the pool branch for short lists, the set branch otherwise.
        setsize = 21
        if remainder > 5:
            p = 1
            while p < remainder * 3:
                p *= 4
            setsize += p
        if n <= setsize:
            for x in range(n):
                pool[x] = slots_JX[j, x]
            for i in range(remainder):
                r = _randbelow(n - i, mt, pos)
                out_K[at + i] = pool[r]
                pool[r] = pool[n - i - 1]
        else:
            for x in range(n):
                taken[x] = False
            for i in range(remainder):
                r = _randbelow(n, mt, pos)
                while taken[r]:
                    r = _randbelow(n, mt, pos)
                taken[r] = True
                out_K[at + i] = slots_JX[j, r]
        # rng.shuffle(ans)
        for i in range(k - 1, 0, -1):
            r = _randbelow(i + 1, mt, pos)
            a = out_K[o + i]
            out_K[o + i] = out_K[o + r]
            out_K[o + r] = a
        o += k
    return o


def seed_state(seed: int) -> np.ndarray:
    """The generator state of `random.Random(seed)`, int64 [625] (Python seeds it)."""
    return np.array(random.Random(seed).getstate()[1], dtype=np.int64)


def python_draws(seed: int, lists: list[list[int]], ks: list[int]) -> list[int]:
    """The picks Python's random makes for the same lists (the reference `warm_up` checks)."""
    rng = random.Random(seed)
    out: list[int] = []
    for arr, k in zip(lists, ks):
        quotient, remainder = divmod(k, len(arr))
        ans = arr * quotient + rng.sample(arr, k=remainder)
        rng.shuffle(ans)
        out += ans
    return out


def draw(seed: int, slots_JX: np.ndarray, count_J: np.ndarray, k_J: np.ndarray) -> np.ndarray:
    """fair_draws from random.Random(seed) on kernel-typed copies of the lists, int64 [sum k_J]."""
    out = np.empty(int(np.sum(k_J)), dtype=np.int64)
    fair_draws(seed_state(seed), np.ascontiguousarray(slots_JX, dtype=np.int64),
               np.ascontiguousarray(count_J, dtype=np.int64), np.ascontiguousarray(k_J, dtype=np.int64), out)
    return out


def warm_up() -> None:
    """Load (or compile) the kernel and check it against Python's draws: lists of 1 to 40
    candidates (both of sample's branches) and 0 to 70 picks, past the generator's first
    624 words; sets `ready` when all agree."""
    global ready
    rng = np.random.default_rng(0)
    count_J = rng.integers(1, 41, 400)
    count_J[:20] = np.arange(1, 21)
    k_J = rng.integers(0, 71, 400)
    slots_JX = np.full((400, 40), -1, dtype=np.int64)
    for j, n in enumerate(count_J):
        slots_JX[j, :n] = rng.choice(1000, n, replace=False)
    got = draw(42, slots_JX, count_J, k_J)
    want = python_draws(42, [slots_JX[j, :n].tolist() for j, n in enumerate(count_J)], k_J.tolist())
    ready = got.tolist() == want
