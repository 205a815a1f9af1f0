"""A keyed bijection on ``[0, n)``: the index permutation behind ``Dataset.global_shuffle``.

``IndexPermutation(n, seed, epoch)`` maps an index to its shuffled index without
materialising the permutation: a Feistel network over the smallest power of two holding
``n`` (halves of ``bits // 2`` and ``bits - bits // 2`` bits, which swap widths each round,
so an odd bit count needs no larger domain; six rounds of a splitmix64-style round function,
the round keys drawn from blake2b of ``(seed, epoch)``), made a permutation of ``[0, n)`` by
cycle walking (an output ``>= n`` is encrypted again until it falls inside; as the network
is a bijection of the larger domain, this is a bijection of ``[0, n)``; the domain is under
``2 * n``, so under two encryptions an index on average). Its state is the round keys and
``n``: O(1) memory whatever ``n``. ``apply`` maps a numpy array of indices at once.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from clusterwire.errors import InvalidArgumentError

ROUNDS = 6
MAX_SIZE = 2 ** 62
_MASK64 = (1 << 64) - 1
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix(value: int) -> int:
    """splitmix64's finaliser on a Python int."""
    value = ((value ^ (value >> 30)) * _C1) & _MASK64
    value = ((value ^ (value >> 27)) * _C2) & _MASK64
    return value ^ (value >> 31)


def _mix_array(value: np.ndarray) -> np.ndarray:
    """``_mix`` of a uint64 array (numpy's uint64 products wrap modulo 2**64, as ``_mix``)."""
    value = (value ^ (value >> np.uint64(30))) * np.uint64(_C1)
    value = (value ^ (value >> np.uint64(27))) * np.uint64(_C2)
    return value ^ (value >> np.uint64(31))


class IndexPermutation:
    """The permutation of ``[0, size)`` keyed by ``(seed, epoch)``."""

    __slots__ = ("size", "_left_bits", "_right_bits", "_keys")

    def __init__(self, size: int, seed: int, epoch: int = 0):
        if not 0 <= size <= MAX_SIZE:
            raise InvalidArgumentError(f"An index permutation covers 0 to {MAX_SIZE} "
                                       f"elements, got {size}.")
        self.size = size
        bits = max(2, (size - 1).bit_length())
        self._left_bits, self._right_bits = bits // 2, bits - bits // 2
        if not -2 ** 63 <= seed < 2 ** 63 or not 0 <= epoch < 2 ** 64:
            raise InvalidArgumentError(f"An index permutation's seed must be an int64 and its "
                                       f"epoch a uint64, got seed {seed}, epoch {epoch}.")
        digest = hashlib.blake2b(struct.pack("<qQ", seed, epoch), digest_size=8 * ROUNDS,
                                 person=b"cw-gshuffle").digest()
        self._keys = struct.unpack(f"<{ROUNDS}Q", digest)

    def _encrypt(self, index: int) -> int:
        left_bits, right_bits = self._left_bits, self._right_bits
        left, right = index >> right_bits, index & ((1 << right_bits) - 1)
        for key in self._keys:
            mask = (1 << left_bits) - 1
            left, right = right, left ^ (_mix((right + key) & _MASK64) & mask)
            left_bits, right_bits = right_bits, left_bits
        return (left << right_bits) | right

    def __call__(self, index: int) -> int:
        """The shuffled index of ``index`` (in ``[0, size)``)."""
        if not 0 <= index < self.size:
            raise InvalidArgumentError(f"Index {index} is outside [0, {self.size}).")
        value = self._encrypt(index)
        while value >= self.size:
            value = self._encrypt(value)
        return value

    def _encrypt_array(self, values: np.ndarray) -> np.ndarray:
        left_bits, right_bits = self._left_bits, self._right_bits
        left = values >> np.uint64(right_bits)
        right = values & np.uint64((1 << right_bits) - 1)
        for key in self._keys:
            mask = np.uint64((1 << left_bits) - 1)
            left, right = right, left ^ (_mix_array(right + np.uint64(key)) & mask)
            left_bits, right_bits = right_bits, left_bits
        return (left << np.uint64(right_bits)) | right

    def apply(self, indices: np.ndarray) -> np.ndarray:
        """The shuffled indices of an int array of indices in ``[0, size)``, as int64."""
        indices = np.asarray(indices)
        if indices.size and not (indices.min() >= 0 and indices.max() < self.size):
            raise InvalidArgumentError(f"Indices {indices.min()}..{indices.max()} are not all "
                                       f"in [0, {self.size}).")
        values = self._encrypt_array(indices.astype(np.uint64))
        size = np.uint64(self.size)
        outside = np.flatnonzero(values >= size)
        while outside.size:
            values[outside] = self._encrypt_array(values[outside])
            outside = outside[values[outside] >= size]
        return values.astype(np.int64)
