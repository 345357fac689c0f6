"""Helpers for property-based fuzzing of decoders: input strategies, two budgets, and guards.

A decoder under fuzz must, for any input, either succeed or raise the project's own error —
never another exception, never hang, never allocate more than its input justifies. The
helpers here make those three checks one line each:

- :data:`values`: any msgpack-shaped value (maps, lists, scalars of every type, big ints);
  :func:`mutations` of a valid template (one field replaced, dropped or a list cut short),
  which reach the deep checks random values rarely do.
- :func:`fuzz` builds a test from a strategy and a check, with the short budget ``make test``
  runs or the long one ``make test-all`` runs (mark the long one ``@pytest.mark.slow``).
- :func:`guarded` runs a call under a wall-clock limit (SIGALRM, so even a blocking system
  call is interrupted) and measures the peak of Python allocations it made;
  :func:`check_bounded` asserts that peak is within a limit, telling the one-time
  allocations of a first call (imports, interpreter and library caches) from those the
  input caused by calling again.
"""

from __future__ import annotations

import contextlib
import signal
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SHORT = settings(
    max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None
)
LONG = settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.integers(min_value=-3, max_value=300)
    | st.floats(allow_nan=True)
    | st.text(max_size=24)
    | st.binary(max_size=24)
)
values: st.SearchStrategy[Any] = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(st.text(max_size=10) | st.integers(-2, 1000), inner, max_size=6)
    ),
    max_leaves=40,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, (*prefix, i))


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def mutations(template: Any) -> st.SearchStrategy[Any]:
    """Copies of ``template`` with one to three places changed: a value replaced by any
    other, a map key dropped, or a list cut short."""
    paths = [p for p in _paths(template) if p]

    @st.composite
    def mutate(draw: st.DrawFn) -> Any:
        out = _copy(template)
        for _ in range(draw(st.integers(1, 3))):
            path = draw(st.sampled_from(paths))
            parent: Any = out
            try:
                for part in path[:-1]:
                    parent = parent[part]
                if not isinstance(parent, (dict, list)):
                    raise TypeError(parent)
                current = parent[path[-1]]
            except (KeyError, IndexError, TypeError):
                continue  # an earlier change removed this place
            how = draw(st.sampled_from(["replace", "replace", "drop", "cut"]))
            if how == "drop" and isinstance(parent, dict):
                del parent[path[-1]]
            elif how == "cut" and isinstance(current, list):
                del current[draw(st.integers(0, len(current))) :]
            else:
                parent[path[-1]] = draw(values)
        return out

    return mutate()


def check_bounded(call: Callable[[], None], limit: int, seconds: float = 5.0) -> None:
    """Run ``call`` (which catches the project's own errors) under :func:`guarded`; assert
    its peak allocation is below ``limit`` bytes, on a second call if the first was over (a
    cache filled once is not an allocation the input justifies or not)."""
    for _ in range(2):
        with guarded(seconds) as peak:
            call()
        if peak[0] < limit:
            return
    raise AssertionError(f"allocated {peak[0]} bytes (twice over the limit of {limit})")


def fuzz(
    strategy: st.SearchStrategy[Any], check: Callable[[Any], None], long: bool = False
) -> Callable[[], None]:
    """A test running ``check`` on inputs drawn from ``strategy`` (short or long budget)."""

    @given(strategy)
    def test(value: Any) -> None:
        check(value)

    return (LONG if long else SHORT)(test)  # type: ignore[no-any-return]


class Hung(Exception):
    """A guarded call ran past its time limit."""


@contextlib.contextmanager
def guarded(seconds: float = 5.0) -> Iterator[list[int]]:
    """Run the body under a wall-clock limit (raises Hung) and yield a list that holds,
    afterwards, the peak bytes of Python allocations made in it (tracemalloc)."""

    def expire(signum: int, frame: Any) -> None:
        raise Hung(f"the call did not return within {seconds} s")

    peak: list[int] = []
    previous = signal.signal(signal.SIGALRM, expire)
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield peak
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        peak.append(max(0, tracemalloc.get_traced_memory()[1] - base))
        if not was_tracing:
            tracemalloc.stop()
