"""Which window a step reads: pure functions of the seed, the step and the sizes of the data, no state.

- :func:`window_starts`: ``--data-order random``, nanoGPT's sampler: each step's start positions drawn with
  replacement from a generator seeded by (seed, step).
- :class:`Permutation`: ``--data-order epoch``: a keyed bijection of ``[0, n)`` (a 6-round Feistel network on
  the smallest even number of bits that holds ``n``, cycle-walking the values ``>= n`` back into range). Pass
  ``p`` of a source reads its windows in the order ``Permutation(n, key(seed, source, p))`` gives, so every
  window is read once per pass, the order differs from pass to pass, and window ``i`` of a pass is computed in
  O(1) time and memory: no permutation of 10^8 windows is ever held.
- :class:`Blend`: a mixture's sample ``g`` (``step * batch + slot``) goes to source ``i`` by nested rounding:
  source 0 takes ``round(f0 * g)`` of the first ``g`` samples (``f0`` its share), source 1 takes its share of
  the rest, and so on. Every source's count among the first ``g`` samples stays within ``k`` (the number of
  sources) of its weight times ``g``, and sample ``g``'s source and its index within that source's own stream
  (``Blend.pick``) are computed in O(k), exactly (rational arithmetic).
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch

_MASK = (1 << 64) - 1
_ROUNDS = 6


def window_starts(seed: int, step: int, count: int, limit: int) -> list:
    """``count`` window positions in ``[0, limit)`` drawn from (seed, step) alone: the same on every rank, run
    and restart."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, limit, (count,), generator=generator).tolist()


def mix(value: int) -> int:
    """splitmix64's finaliser: a 64-bit integer -> a well-mixed 64-bit integer."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def key(*parts: int) -> int:
    """One 64-bit key from integers (seed, source, pass)."""
    value = 0x243F6A8885A308D3
    for part in parts:
        value = mix(value ^ (part & _MASK))
    return value


_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


class Permutation:
    """A keyed bijection of ``[0, n)``: ``perm(indices)`` maps an int64 array."""

    def __init__(self, n: int, seed_key: int):
        if n < 1:
            raise ValueError(f"a permutation of {n} items")
        bits = max((n - 1).bit_length(), 2)
        bits += bits % 2
        self.n, self.half = n, np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        self.keys = [np.uint64(key(seed_key, round_)) for round_ in range(_ROUNDS)]

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for round_key in self.keys:
            z = (right ^ round_key) * _C1
            z = (z ^ (z >> np.uint64(29))) * _C2
            z ^= z >> np.uint64(32)
            left, right = right, left ^ (z & self.mask)
        return (left << self.half) | right

    def __call__(self, indices) -> np.ndarray:
        x = np.asarray(indices, dtype=np.uint64)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"index {int(x.max())} of a permutation of {self.n}")
        with np.errstate(over="ignore"):
            x = self._rounds(x)
            outside = x >= np.uint64(self.n)
            while outside.any():  # cycle-walking: at most a few rounds (the domain is under 4n)
                x[outside] = self._rounds(x[outside])
                outside = x >= np.uint64(self.n)
        return x.astype(np.int64)


class Blend:
    """A mixture's interleave: ``pick(g)`` -> (source, index of the sample within that source's stream);
    ``counts(g)`` -> how many of the first ``g`` samples each source took."""

    def __init__(self, weights: list):
        weights = [Fraction(weight) for weight in weights]
        self.k = len(weights)
        self.shares = []  # level i: source i's share of what sources i.. take, as (numerator, denominator)
        for i in range(self.k - 1):
            share = weights[i] / sum(weights[i:])
            self.shares.append((share.numerator, share.denominator))

    @staticmethod
    def _taken(share: tuple, count: int) -> int:
        p, q = share
        return (2 * p * count + q) // (2 * q)  # round(share * count), halves up

    def pick(self, g: int) -> tuple:
        for i, share in enumerate(self.shares):
            before = self._taken(share, g)
            if self._taken(share, g + 1) > before:
                return i, before
            g -= before  # the index among the samples the later sources share
        return self.k - 1, g

    def counts(self, g: int) -> list:
        out = []
        for share in self.shares:
            taken = self._taken(share, g)
            out.append(taken)
            g -= taken
        return out + [g]
