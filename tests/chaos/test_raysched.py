"""The fault sequence of a chaos campaign on Ray: every sequence it draws is one the Ray
driver accepts, strikes no rank twice, never a whole host 0, and loses no more ranks than
the spare nodes can take."""

from __future__ import annotations

import pytest

from peerckpt.chaos.raysched import check_ray_campaign, generate_ray
from peerckpt.chaos.spec import parse_chaos
from peerckpt.errors import ConfigurationError
from peerckpt.launch.campaign import place
from peerckpt.launch.rayplan import split_chaos

SHAPES = [(2, 1, 1), (2, 2, 1), (2, 2, 2), (3, 2, 2), (4, 1, 3)]


def _lost_and_struck(clauses: list[str], nproc: int) -> tuple[int, list[int], list[int]]:
    """Ranks lost, ranks named (each clause's), hosts lost whole, as the rules count them."""
    lost, named, hosts = 0, [], []
    for clause in clauses:
        words = dict(w.split("=", 1) for w in clause.split() if "=" in w)
        if "rank" in words:
            named.append(int(words["rank"]))
            lost += 1
        elif clause.startswith(("kill node", "kill agent")):
            host = int(words["node"])
            hosts.append(host)
            on = [r for r in range(host * nproc, (host + 1) * nproc) if r not in named]
            lost += len(on)
            named += on
    return lost, named, hosts


@pytest.mark.parametrize(("nodes", "nproc", "spare_nodes"), SHAPES)
def test_every_drawn_sequence_is_one_the_ray_driver_accepts(nodes, nproc, spare_nodes) -> None:
    for seed in range(60):
        clauses = generate_ray(seed, 6, nodes, nproc, spare_nodes, 5, 3, 3.0)
        assert len(clauses) == 6
        split_chaos("; ".join(clauses), nproc)  # raises on a sequence the driver refuses
        lost, named, hosts = _lost_and_struck(clauses, nproc)
        assert lost <= spare_nodes * nproc, clauses
        assert len(named) == len(set(named)), f"a rank struck twice: {clauses}"
        assert 0 not in hosts and len(hosts) == len(set(hosts)), clauses
        assert all(c.split(" at=")[0] != "corrupt" for c in clauses)
        steps = [a.at for a in parse_chaos("; ".join(clauses))]
        assert steps == list(range(5, 5 + 3 * 6, 3))


def test_the_sequence_is_the_seeds_and_draws_every_kind() -> None:
    assert generate_ray(7, 5, 3, 2, 2, 5, 2, 3.0) == generate_ray(7, 5, 3, 2, 2, 5, 2, 3.0)
    drawn = [c for seed in range(40) for c in generate_ray(seed, 4, 3, 2, 2, 5, 2, 3.0)]
    kinds = {c.split("=")[0].rsplit(" ", 1)[0] for c in drawn}
    assert kinds == {"kill", "kill agent", "kill coordinator", "hang", "partition", "slow"}
    assert any(c.startswith("kill node=") for c in drawn)
    assert any(c.endswith("during=snapshot") for c in drawn)
    assert any(c.startswith("kill coordinator") for c in drawn)


def test_place_spreads_the_ray_sequence_inside_the_steps() -> None:
    def draw(n: int, first: int, gap: int) -> list[str]:
        return generate_ray(3, n, 2, 2, 2, first, gap, 3.0)

    clauses = place(3, 4, 4, 5, None, 3.0, 40, draw)
    assert [a.at for a in parse_chaos("; ".join(clauses))] == [5, 15, 25, 35]
    with pytest.raises(ConfigurationError, match="--every"):
        place(3, 4, 4, 5, 20, 3.0, 40, draw)


@pytest.mark.parametrize(("nodes", "spares", "what"), [(1, 1, "--nodes"), (2, 0, "--spares")])
def test_a_campaign_shape_ray_cannot_run_is_refused(nodes, spares, what) -> None:
    with pytest.raises(ConfigurationError, match=what):
        check_ray_campaign(nodes, 2, spares)
