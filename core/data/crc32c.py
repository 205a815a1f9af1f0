"""CRC-32C (Castagnoli) and TFRecord's masked form of it.

google-crc32c (``pip install 'clusterwire[data]'``) is Google's C library with the
SSE4.2 / ARMv8 CRC instructions, as TensorFlow itself uses (it releases the GIL for
``bytes`` of 1 MiB or more). Without it a numpy fallback computes the same value: the
CRC is linear over GF(2), so every byte's contribution to a block's CRC is one table
lookup (a table per position in the block), the block's contributions are XOR-reduced
in numpy, and the blocks' CRCs are combined pairwise, a level at a time (carrying a
register over 2^k blocks of zeros is four table lookups, a table set per level): numpy
passes only, no Python loop per block. Short inputs take the classic byte loop.
"""

from __future__ import annotations

import functools

import numpy as np

try:
    import google_crc32c
except ImportError:  # pragma: no cover - exercised only without the extra
    google_crc32c = None

_POLY = 0x82F63B78  # CRC-32C, bit-reflected
_MASK_DELTA = 0xA282EAD8
_BLOCK = 1024  # bytes per block of the numpy fallback
_SHORT = 64  # below this the fallback's byte loop is cheaper than numpy's set-up


def accelerated() -> bool:
    """Whether CRC-32C runs in google-crc32c's C code (else in the numpy fallback)."""
    return google_crc32c is not None and google_crc32c.implementation == "c"


def value(data: bytes | bytearray | memoryview) -> int:
    """The CRC-32C of ``data``, as an unsigned 32-bit int."""
    if google_crc32c is not None:
        # The C call takes bytes or a read-only-exporting buffer such as numpy's, not a
        # memoryview or bytearray; the numpy view is free.
        return google_crc32c.value(data if type(data) is bytes else np.frombuffer(data, np.uint8))
    return _numpy_value(data)


def masked(data: bytes | bytearray | memoryview) -> int:
    """TFRecord's masked CRC-32C of ``data`` (rotated right by 15 bits, plus a constant)."""
    crc = value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


@functools.cache
def _byte_table() -> np.ndarray:
    crc = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        crc = np.where(crc & 1, (crc >> 1) ^ np.uint32(_POLY), crc >> 1)
    return crc


def _zero_byte(register: np.ndarray) -> np.ndarray:
    """The raw register after one more zero byte (vectorised over ``register``)."""
    return (register >> 8) ^ _byte_table()[register & 0xFF]


@functools.cache
def _position_tables() -> np.ndarray:
    """(_BLOCK, 256): the raw CRC (zero start, no final inversion) of a block holding only
    byte b at position j."""
    positions = np.empty((_BLOCK, 256), dtype=np.uint32)
    row = _byte_table()
    for j in range(_BLOCK - 1, -1, -1):
        positions[j] = row
        row = _zero_byte(row)
    return positions


def _carry(tables: np.ndarray, registers: np.ndarray) -> np.ndarray:
    """``registers`` carried over the zeros ``tables`` stands for (4 x 256: the register's
    byte k with value b, carried)."""
    return (tables[0][registers & 0xFF] ^ tables[1][(registers >> 8) & 0xFF]
            ^ tables[2][(registers >> 16) & 0xFF] ^ tables[3][registers >> 24])


@functools.cache
def _level_tables(level: int) -> np.ndarray:
    """The carry tables over 2^level blocks of zeros."""
    if level == 0:
        tables = np.arange(256, dtype=np.uint32)[None, :] << (
            8 * np.arange(4, dtype=np.uint32)[:, None])
        for _ in range(_BLOCK):
            tables = _zero_byte(tables)
        return tables
    half = _level_tables(level - 1)
    return _carry(half, half)


def _loop_value(data: bytes | bytearray | memoryview) -> int:
    table = _byte_table().tolist()
    crc = 0xFFFFFFFF
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _numpy_value(data: bytes | bytearray | memoryview) -> int:
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size < _SHORT:
        return _loop_value(raw.tobytes())
    # The start value ~0 equals XOR-ing 0xFF into the first four bytes with a zero start;
    # leading zero bytes leave a zero register unchanged, so the front is padded to a
    # power of two of whole blocks.
    blocks = -(-raw.size // _BLOCK)
    levels = (blocks - 1).bit_length()
    message = np.zeros((1 << levels) * _BLOCK, dtype=np.uint8)
    message[message.size - raw.size:] = raw
    message[message.size - raw.size:message.size - raw.size + 4] ^= 0xFF
    positions, columns = _position_tables(), np.arange(_BLOCK)
    rows = message.reshape(-1, _BLOCK)
    crcs = np.concatenate([  # each block's raw CRC, 1024 blocks at a time (bounded memory)
        np.bitwise_xor.reduce(positions[columns, rows[start:start + 1024]], axis=1)
        for start in range(0, len(rows), 1024)])
    for level in range(levels):  # CRC(A || B) = carry(CRC(A), len(B)) ^ CRC(B)
        crcs = _carry(_level_tables(level), crcs[0::2]) ^ crcs[1::2]
    return int(crcs[0]) ^ 0xFFFFFFFF
