"""Erasure-coded redundancy (``--erasure K+M``): the code and its layout over a group.

A *group* is g ≥ K + M ranks on g distinct nodes (the coordinator forms groups from nodes:
``recovery/erasure.py``); a rank's place in its group is its *position*. Each rank's coded
bytes (its snapshot, less chunks its data-parallel twins hold) are cut into k equal
*pieces*. There are g *stripes*; stripe j is k data pieces and m parity pieces::

    parity  of stripe j: positions j, j+1, …, j+m−1          (mod g), rows t = 0 … m−1
    data    of stripe j: positions j+m, j+m+1, …, j+m+k−1     (mod g), piece p = 0 … k−1

so position i holds its own k pieces (in stripes i−m−p) and the parity of m stripes (i−t),
and stripe j's k + m pieces lie on k + m distinct nodes. Lose any m nodes of a group and
every stripe keeps at least k of its pieces: every lost piece is rebuilt from k survivors.
Each node keeps m parity pieces of 1/k of a rank's state: redundancy m/k of it, against k
whole copies with ``--replicas k``. A group smaller than K + M (a job shrunk below it)
codes with k = g − m; g ≤ m cannot be protected.

The code is systematic and MDS: parity row t of stripe j is Σ_p P[t][p] · d_p over
GF(2^8) (``peerckpt/gf256.py``), P a Cauchy matrix scaled so that row 0 is all ones (every
square submatrix of a Cauchy matrix is invertible, and scaling columns keeps it so): with
m = 1 the parity is the XOR of the pieces. Pieces of one stripe may differ in length (ranks
differ in size); shorter ones count as zero-padded, and the parity is as long as the
longest.

The invariant this keeps, erasure's counterpart of DESIGN.md's k + 1 copies (enforced at
commit: a step commits only when every rank's every piece is acknowledged by each of the m
parity holders of its stripe, crc32c checked, which is when every stripe's parity of that
step is complete and checksummed): *every chunk of the latest committed step lives complete
and checksummed on its own node, and every stripe holding it has its m parity pieces of
that step complete and checksummed on m other nodes of its group, so that any m failure
domains of the group may be lost together*.

Pure functions, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from peerckpt.gf256 import inv, mat_inv, mul

MAX_SYMBOLS = 255  # k + m: distinct Cauchy points in GF(2^8)


@dataclass(frozen=True)
class ErasureSpec:
    """``--erasure K+M``: K data pieces and M parity pieces per stripe."""

    k: int
    m: int

    def __str__(self) -> str:
        return f"{self.k}+{self.m}"

    @property
    def width(self) -> int:
        return self.k + self.m


def parse_spec(text: str) -> ErasureSpec:
    """``"3+1"`` → ErasureSpec(3, 1); ValueError naming the form otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*\+\s*(\d+)\s*", text or "")
    if match is None:
        raise ValueError(
            f"--erasure {text!r}: give K+M, the data and parity pieces per stripe, e.g. 3+1 "
            "(survives any 1 node of a group of 4) or 4+2"
        )
    k, m = int(match.group(1)), int(match.group(2))
    if k < 1 or m < 1 or k + m > MAX_SYMBOLS:
        raise ValueError(
            f"--erasure {text}: K and M must be at least 1 and K+M at most {MAX_SYMBOLS}"
        )
    return ErasureSpec(k, m)


def group_k(spec: ErasureSpec, size: int) -> int:
    """The data pieces per stripe in a group of ``size`` ranks: K, fewer in a small group
    (still surviving M losses); 0 when the group cannot be protected (size ≤ M)."""
    return max(0, min(spec.k, size - spec.m))


@cache
def parity_matrix(k: int, m: int) -> tuple[tuple[int, ...], ...]:
    """P[t][p], m × k, row 0 all ones; every square submatrix invertible."""
    cauchy = [[inv(t ^ (m + p)) for p in range(k)] for t in range(m)]
    scale = [inv(cauchy[0][p]) for p in range(k)]
    return tuple(tuple(mul(cauchy[t][p], scale[p]) for p in range(k)) for t in range(m))


def generator_row(k: int, m: int, symbol: int) -> tuple[int, ...]:
    """Symbol ``symbol``'s row of the generator: data piece p < k, then parity row t."""
    if symbol < k:
        return tuple(int(p == symbol) for p in range(k))
    return parity_matrix(k, m)[symbol - k]


def decode_rows(k: int, m: int, available: Sequence[int]) -> list[list[int]]:
    """Coefficients that give each data piece from the k symbols ``available`` (symbol
    numbers as in ``generator_row``, in that order): data p = Σ_s rows[p][s] · symbol_s."""
    if len(available) != k or len(set(available)) != k:
        raise ValueError(f"decoding needs exactly {k} distinct symbols, got {list(available)}")
    return mat_inv([list(generator_row(k, m, s)) for s in available])


@dataclass(frozen=True)
class Stripe:
    """Stripe ``index`` of a group of ``size``: its parity and data positions."""

    index: int
    size: int
    k: int
    m: int

    @property
    def parity(self) -> list[int]:
        return [(self.index + t) % self.size for t in range(self.m)]

    @property
    def data(self) -> list[int]:
        return [(self.index + self.m + p) % self.size for p in range(self.k)]

    def symbol_at(self, position: int) -> int | None:
        """The symbol (data piece p, or k + parity row) that ``position`` holds here."""
        off = (position - self.index) % self.size
        if off < self.m:
            return self.k + off
        if off < self.m + self.k:
            return off - self.m
        return None


def stripe_of_piece(size: int, k: int, m: int, position: int, piece: int) -> Stripe:
    """The stripe in which ``position`` keeps its piece ``piece``."""
    return Stripe((position - m - piece) % size, size, k, m)


def parity_stripes(size: int, k: int, m: int, position: int) -> list[tuple[Stripe, int]]:
    """(stripe, row) of every parity piece ``position`` keeps."""
    return [(Stripe((position - t) % size, size, k, m), t) for t in range(m)]


def piece_length(total: int, k: int) -> int:
    """Bytes of one of ``k`` pieces of ``total`` coded bytes (the last may be shorter)."""
    return -(-total // k) if total else 0


def piece_ranges(ranges: Sequence[tuple[int, int]], k: int, piece: int) -> list[tuple[int, int]]:
    """The slot byte ranges of piece ``piece``: the coded bytes are ``ranges`` (start, end,
    ascending) one after another, cut into k pieces of ``piece_length``."""
    total = sum(end - start for start, end in ranges)
    size = piece_length(total, k)
    lo, hi = piece * size, min(total, (piece + 1) * size)
    out: list[tuple[int, int]] = []
    at = 0
    for start, end in ranges:
        n = end - start
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            out.append((start + a - at, start + b - at))
        at += n
    return out


@dataclass(frozen=True)
class Group:
    """A coding group as the layout of one step: its ranks by position and their nodes."""

    ranks: tuple[int, ...]
    nodes: tuple[int, ...]
    k: int
    m: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def position(self, rank: int) -> int:
        return self.ranks.index(rank)

    def to_msg(self) -> list[list[int]]:
        return [[r, n] for r, n in zip(self.ranks, self.nodes, strict=True)]


@dataclass(frozen=True)
class Coding:
    """One step's coding layout: ``spec`` and the groups (what the ``Membership`` carries)."""

    spec: ErasureSpec
    groups: tuple[Group, ...]

    def group_of(self, rank: int) -> Group | None:
        return next((g for g in self.groups if rank in g.ranks), None)

    def to_msg(self) -> dict[str, object]:
        return {"k": self.spec.k, "m": self.spec.m, "groups": [g.to_msg() for g in self.groups]}

    @classmethod
    def from_msg(cls, msg: Mapping[str, object]) -> Coding:
        spec = ErasureSpec(int(msg["k"]), int(msg["m"]))  # type: ignore[call-overload]
        groups = []
        for pairs in msg["groups"]:  # type: ignore[attr-defined]
            ranks = tuple(int(r) for r, _ in pairs)
            nodes = tuple(int(n) for _, n in pairs)
            groups.append(Group(ranks, nodes, group_k(spec, len(ranks)), spec.m))
        return cls(spec, tuple(groups))


def stripe_survivors(
    group: Group, stripe: Stripe, data_alive: set[int], nodes_alive: set[int]
) -> list[tuple[int, int]]:
    """(position, symbol) of the stripe's pieces still readable: data pieces of ranks in
    ``data_alive``, parity pieces on nodes in ``nodes_alive`` (as placed at the step)."""
    out = []
    for pos in stripe.data:
        if group.ranks[pos] in data_alive:
            out.append((pos, stripe.symbol_at(pos)))
    for pos in stripe.parity:
        if group.nodes[pos] in nodes_alive:
            out.append((pos, stripe.symbol_at(pos)))
    return [(p, s) for p, s in out if s is not None]


def rebuildable(group: Group, rank: int, data_alive: set[int], nodes_alive: set[int]) -> bool:
    """Whether ``rank``'s pieces can be rebuilt: each of its stripes keeps k pieces."""
    if group.k < 1:
        return False
    pos = group.position(rank)
    for piece in range(group.k):
        stripe = stripe_of_piece(group.size, group.k, group.m, pos, piece)
        if len(stripe_survivors(group, stripe, data_alive, nodes_alive)) < group.k:
            return False
    return True


def survives(coding: Coding, lost: set[int]) -> bool:
    """Whether the parity rebuilds every rank of the nodes ``lost`` (lost together, every other
    node alive). Losing fewer nodes is survived whenever losing more is, so a set of chunks held
    on the nodes ``T`` outlives every loss the parity survives exactly when ``survives(T)`` is
    false: the rule by which data-parallel twins stand in for parity (``recovery/twins.py``)."""
    placed = [(r, n) for g in coding.groups for r, n in zip(g.ranks, g.nodes, strict=True)]
    alive_ranks = {r for r, n in placed if n not in lost}
    for group in coding.groups:
        hit = [r for r, n in zip(group.ranks, group.nodes, strict=True) if n in lost]
        if not hit:
            continue
        if group.k < 1 or (group.size == group.k + group.m and len(hit) > group.m):
            return False  # every stripe of a K + M group spans all of it: more than M is too many
        nodes_alive = {n for n in group.nodes if n not in lost}
        if not all(rebuildable(group, r, alive_ranks, nodes_alive) for r in hit):
            return False
    return True
