"""Arithmetic in GF(2^8) for erasure coding: scalars, small matrices, and byte regions.

The field is GF(2)[x] / (x^8 + x^4 + x^3 + x^2 + 1) (0x11d, ISA-L's and Jerasure's), so
adding two symbols is XOR and multiplying is a table look-up.

Region kernels (``mul_into``, ``mad_into``) work on numpy uint8 arrays and are what the
agents spend their encoding CPU on. Why our own kernels and not a library's (measured on
this machine, 64 MiB, ``bench/erasure.py`` records it again): every Python binding of a
Galois-field library encodes whole stripes only and copies through Python objects —
pyeclib over ISA-L 0.27 GB/s, zfec 0.30, galois 0.16 (a scalar times an array), reedsolo
0.0014 — while a parity holder here folds each data piece into its parity as the piece
arrives, which needs "parity ^= c · piece", ISA-L's ``gf_vect_mad``, that no maintained
binding exposes. With c = 1 (the first parity row of our code is all ones, so K+1 is plain
XOR parity) that is numpy's XOR at memory speed (≈ memcpy); any other c is a look-up of two
bytes at a time in a 128 KiB table (``np.take`` on uint16, ≈ 1 GB/s, 4× the byte table).

Pure functions and module constants, no I/O.
"""

from __future__ import annotations

from functools import cache

import numpy as np

POLY = 0x11D
_BLOCK = 1 << 19  # elements per look-up block: bounds numpy's int index temporaries


def _tables() -> tuple[list[int], list[int]]:
    exp, log = [0] * 510, [0] * 256
    value = 1
    for i in range(255):
        exp[i], log[value] = value, i
        value <<= 1
        if value & 0x100:
            value ^= POLY
    for i in range(255, 510):
        exp[i] = exp[i - 255]
    return exp, log


EXP, LOG = _tables()


def mul(a: int, b: int) -> int:
    """a · b in GF(2^8)."""
    if a == 0 or b == 0:
        return 0
    return EXP[LOG[a] + LOG[b]]


def inv(a: int) -> int:
    """The multiplicative inverse of ``a`` (ZeroDivisionError for 0)."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return EXP[255 - LOG[a]]


def mat_inv(matrix: list[list[int]]) -> list[list[int]]:
    """The inverse of a square matrix over GF(2^8) (Gauss–Jordan); ValueError if singular."""
    n = len(matrix)
    a = [list(row) + [int(i == j) for j in range(n)] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if a[r][col]), None)
        if pivot is None:
            raise ValueError("singular matrix over GF(2^8)")
        a[col], a[pivot] = a[pivot], a[col]
        scale = inv(a[col][col])
        a[col] = [mul(scale, v) for v in a[col]]
        for r in range(n):
            if r != col and a[r][col]:
                f = a[r][col]
                a[r] = [v ^ mul(f, w) for v, w in zip(a[r], a[col], strict=True)]
    return [row[n:] for row in a]


@cache
def _table16(c: int) -> np.ndarray:
    """c times each of two bytes at once: index a uint16, get both products as a uint16."""
    row = np.array([mul(c, b) for b in range(256)], dtype=np.uint16)
    idx = np.arange(65536, dtype=np.uint32)
    return (row[idx & 0xFF] | (row[idx >> 8] << 8)).astype(np.uint16)


def _pairs(a: np.ndarray) -> np.ndarray | None:
    """``a`` as uint16 pairs when its length and address allow it."""
    if a.size % 2 or a.ctypes.data % 2:
        return None
    return a.view(np.uint16)


def mul_into(dst: np.ndarray, src: np.ndarray, c: int) -> None:
    """dst[:] = c · src (equal lengths, uint8)."""
    if c == 1:
        np.copyto(dst, src)
    elif c == 0:
        dst.fill(0)
    else:
        _mul_blocks(dst, src, c, accumulate=False)


def mad_into(dst: np.ndarray, src: np.ndarray, c: int) -> None:
    """dst ^= c · src (equal lengths, uint8): ISA-L's ``gf_vect_mad``."""
    if c == 1:
        d64, s64 = _words(dst), _words(src)
        if d64 is not None and s64 is not None:
            np.bitwise_xor(d64, s64, out=d64)
        else:
            np.bitwise_xor(dst, src, out=dst)
    elif c != 0:
        _mul_blocks(dst, src, c, accumulate=True)


def _words(a: np.ndarray) -> np.ndarray | None:
    if a.size % 8 or a.ctypes.data % 8:
        return None
    return a.view(np.uint64)


def _mul_blocks(dst: np.ndarray, src: np.ndarray, c: int, accumulate: bool) -> None:
    d16, s16 = _pairs(dst), _pairs(src)
    if d16 is None or s16 is None:  # odd length or address: one byte at a time
        row = _table16(c)[:256].astype(np.uint8)
        for start in range(0, src.size, _BLOCK):
            part = np.take(row, src[start : start + _BLOCK])
            _store(dst[start : start + _BLOCK], part, accumulate)
        return
    table = _table16(c)
    scratch = np.empty(min(_BLOCK, s16.size), dtype=np.uint16)
    for start in range(0, s16.size, _BLOCK):
        chunk = s16[start : start + _BLOCK]
        out = scratch[: chunk.size]
        np.take(table, chunk, out=out)
        _store(d16[start : start + _BLOCK], out, accumulate)


def _store(dst: np.ndarray, value: np.ndarray, accumulate: bool) -> None:
    if accumulate:
        np.bitwise_xor(dst, value, out=dst)
    else:
        np.copyto(dst, value)
