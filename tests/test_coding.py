"""The erasure code and its layout (peerckpt/coding.py, peerckpt/gf256.py), hammered."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerckpt import coding, gf256
from peerckpt.coding import ErasureSpec, Group, Stripe


def _ref_mul(a: int, b: int) -> int:
    """Carry-less multiply reduced by 0x11d, bit by bit: independent of the tables."""
    out = 0
    while b:
        if b & 1:
            out ^= a
        b >>= 1
        a <<= 1
        if a & 0x100:
            a ^= gf256.POLY
    return out


def test_tables_agree_with_a_bitwise_multiply() -> None:
    for a in range(256):
        for b in range(0, 256, 7):
            assert gf256.mul(a, b) == _ref_mul(a, b)
    assert all(gf256.mul(a, gf256.inv(a)) == 1 for a in range(1, 256))


@given(
    st.integers(0, 255),
    st.binary(min_size=0, max_size=300),
    st.integers(0, 1),
    st.booleans(),
)
def test_region_kernels_match_the_scalar_multiply(
    c: int, raw: bytes, skew: int, accumulate: bool
) -> None:
    buf = np.frombuffer(b"\0" * skew + raw, dtype=np.uint8)[skew:]  # odd addresses too
    src = buf.copy() if skew == 0 else buf
    base = np.arange(len(raw), dtype=np.uint8)
    dst = base.copy()
    (gf256.mad_into if accumulate else gf256.mul_into)(dst, src, c)
    want = [(b if accumulate else 0) ^ _ref_mul(c, s) for b, s in zip(base, raw, strict=True)]
    assert dst.tolist() == want


@given(st.integers(1, 6), st.integers(1, 3), st.data())
@settings(max_examples=60, deadline=None)
def test_any_k_symbols_rebuild_every_data_piece(k: int, m: int, data: st.DataObject) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    pieces = [rng.integers(0, 256, 37, dtype=np.uint8) for _ in range(k)]
    parity = []
    for t in range(m):
        out = np.zeros(37, dtype=np.uint8)
        for p, piece in enumerate(pieces):
            gf256.mad_into(out, piece, coding.parity_matrix(k, m)[t][p])
        parity.append(out)
    symbols = pieces + parity
    available = sorted(data.draw(st.sets(st.integers(0, k + m - 1), min_size=k, max_size=k)))
    rows = coding.decode_rows(k, m, available)
    for p in range(k):
        got = np.zeros(37, dtype=np.uint8)
        for s, coef in zip(available, rows[p], strict=True):
            gf256.mad_into(got, symbols[s], coef)
        assert np.array_equal(got, pieces[p])


def test_the_first_parity_row_is_xor() -> None:
    assert coding.parity_matrix(3, 2)[0] == (1, 1, 1)


@given(st.integers(1, 5), st.integers(1, 3), st.integers(0, 4))
def test_a_group_spreads_pieces_and_parity_evenly(k: int, m: int, extra: int) -> None:
    size = k + m + extra
    stripes = [Stripe(j, size, k, m) for j in range(size)]
    for s in stripes:
        assert len(set(s.data) | set(s.parity)) == k + m  # distinct nodes per stripe
    for pos in range(size):
        held = [s.symbol_at(pos) for s in stripes]
        assert sum(1 for h in held if h is not None and h < k) == k
        assert sum(1 for h in held if h is not None and h >= k) == m
        for piece in range(k):
            s = coding.stripe_of_piece(size, k, m, pos, piece)
            assert s.symbol_at(pos) == piece
        for s, row in coding.parity_stripes(size, k, m, pos):
            assert s.symbol_at(pos) == k + row


@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 3), st.data())
def test_any_m_lost_nodes_leave_every_rank_rebuildable(
    k: int, m: int, extra: int, data: st.DataObject
) -> None:
    size = k + m + extra
    group = Group(tuple(range(size)), tuple(range(10, 10 + size)), k, m)
    lost = data.draw(st.sets(st.integers(0, size - 1), max_size=m))
    alive_ranks = {r for r in group.ranks if r not in lost}
    alive_nodes = {group.nodes[r] for r in alive_ranks}
    for rank in lost:
        assert coding.rebuildable(group, rank, alive_ranks, alive_nodes)


def test_m_plus_one_lost_nodes_of_a_tight_group_are_not_rebuildable() -> None:
    k, m = 3, 2
    group = Group(tuple(range(5)), tuple(range(5)), k, m)
    for lost in itertools.combinations(range(5), m + 1):
        alive = set(range(5)) - set(lost)
        assert not any(coding.rebuildable(group, r, alive, alive) for r in lost)


@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=5),
    st.integers(1, 6),
)
def test_pieces_cut_the_coded_bytes_in_order_without_overlap(
    spans: list[tuple[int, int]], k: int
) -> None:
    ranges, at = [], 0
    for gap, n in spans:
        ranges.append((at + gap, at + gap + n))
        at += gap + n
    flat = [b for s, e in ranges for b in range(s, e)]
    got = [b for p in range(k) for s, e in coding.piece_ranges(ranges, k, p) for b in range(s, e)]
    assert got == flat
    size = coding.piece_length(len(flat), k)
    assert all(sum(e - s for s, e in coding.piece_ranges(ranges, k, p)) <= size for p in range(k))


@pytest.mark.parametrize(
    ("text", "spec"), [("3+1", ErasureSpec(3, 1)), (" 4 + 2 ", ErasureSpec(4, 2))]
)
def test_specs_parse(text: str, spec: ErasureSpec) -> None:
    assert coding.parse_spec(text) == spec


@pytest.mark.parametrize("text", ["3", "0+1", "3+0", "a+b", "200+100", ""])
def test_bad_specs_name_the_form(text: str) -> None:
    with pytest.raises(ValueError, match="--erasure"):
        coding.parse_spec(text)


def test_a_small_group_codes_with_fewer_data_pieces() -> None:
    spec = ErasureSpec(3, 2)
    assert coding.group_k(spec, 5) == 3
    assert coding.group_k(spec, 4) == 2
    assert coding.group_k(spec, 2) == 0
    msg = coding.Coding(spec, (Group((0, 1, 2, 3), (0, 1, 2, 3), 2, 2),)).to_msg()
    back = coding.Coding.from_msg(msg)
    assert back.groups[0].k == 2 and back.group_of(3) is not None
