"""Property-based tests of the pool entry points fed finite, endless and failing iterables (hypothesis).

Every entry point must give the serial result over a finite iterable of any kind (list, tuple, range,
generator, iterator); ``imap``/``imap_unordered`` must yield at once over an endless one with bounded
read-ahead, and over a failing one yield the results of the elements before the failure, then raise its
exception; ``map``/``starmap`` raise it from the call, as the stdlib does. ``nox -s tests`` runs a few
derandomized examples; ``nox -s adversarial`` runs ``PC_ADVERSARIAL_EXAMPLES``; ``PC_ADVERSARIAL_SEED=N``
explores others. A failure prints hypothesis's falsifying example and the seed line.
"""

from __future__ import annotations

import itertools
import operator
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pool_testutils as tu
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pc_pool

pytestmark = pytest.mark.adversarial

READ_AHEAD_PER_WORKER = 8  # the documented bound of imap's read-ahead
GUARD = 10_000  # an endless iterable read this far was read eagerly (keeps a regression from eating memory)


class IterableError(Exception):
    """An iterable's own exception type (not one the pool raises)."""


ERRORS = [IterableError, KeyError, ValueError, RuntimeError, StopAsyncIteration]


@pytest.fixture(params=["ThreadPool", "Pool"], scope="module")
def pool(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A 2-worker thread pool and a fork process pool, one per module (terminated at its end)."""
    if request.param == "ThreadPool":
        made: Any = pc_pool.ThreadPool(2)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
            made = pc_pool.Pool(2, share_method="cpu")
    try:
        yield made
    finally:
        made.terminate()
        made.join(tu.T)


def _shaped(items: list[int], shape: str) -> Iterable[int]:
    if shape == "list":
        return list(items)
    if shape == "tuple":
        return tuple(items)
    if shape == "generator":
        return (x for x in items)
    return iter(items)


class Source:
    """``items``, then ``error`` (if any) or, when ``endless``, more numbers for ever; counts its reads."""

    def __init__(
        self, items: list[int], error: type[BaseException] | None = None, endless: bool = False
    ) -> None:
        self.items = items
        self.error = error
        self.endless = endless
        self.produced = 0

    def __iter__(self) -> Iterator[int]:
        for x in self.items:
            self.produced += 1
            yield x
        if self.error is not None:
            raise self.error("from the iterable")
        if self.endless:
            for x in itertools.count(len(self.items)):
                if self.produced >= GUARD:
                    raise AssertionError(f"read {GUARD} elements of an endless iterable ahead of the caller")
                self.produced += 1
                yield x


def _drain(it: Any) -> tuple[list[Any], BaseException | None]:
    got: list[Any] = []
    try:
        while True:
            got.append(it.next(timeout=tu.T))
    except StopIteration:
        return got, None
    except Exception as exc:
        return got, exc


_items = st.lists(st.integers(-1000, 1000), max_size=30)


@given(
    items=_items,
    shape=st.sampled_from(["list", "tuple", "generator", "iterator"]),
    form=st.sampled_from(["map", "map_async", "imap", "imap_unordered", "starmap"]),
)
def test_finite_iterables_give_the_serial_result(pool: Any, items: list[int], shape: str, form: str) -> None:
    if form == "starmap":
        got = pool.starmap(operator.add, _shaped([(x, x) for x in items], shape))  # type: ignore[arg-type]
        assert got == [2 * x for x in items]
        return
    if form == "map_async":
        got = pool.map_async(tu.ident, _shaped(items, shape)).get(tu.T)
    else:
        got = getattr(pool, form)(tu.ident, _shaped(items, shape))
        got = list(got) if form == "map" else _drain(got)[0]
    assert (sorted(got) if form == "imap_unordered" else got) == (
        sorted(items) if form == "imap_unordered" else items
    )


@given(
    items=_items,
    error=st.sampled_from(ERRORS),
    form=st.sampled_from(["imap", "imap_unordered"]),
)
def test_imap_over_a_failing_iterable_yields_the_prefix_then_its_error(
    pool: Any, items: list[int], error: type[BaseException], form: str
) -> None:
    got, exc = _drain(getattr(pool, form)(tu.ident, iter(Source(items, error))))
    assert (sorted(got) if form == "imap_unordered" else got) == (
        sorted(items) if form == "imap_unordered" else items
    )
    assert type(exc) is error


@given(items=_items, error=st.sampled_from(ERRORS), form=st.sampled_from(["map", "map_async", "starmap"]))
def test_map_over_a_failing_iterable_raises_its_error(
    pool: Any, items: list[int], error: type[BaseException], form: str
) -> None:
    source = iter(Source(items, error))
    if form == "starmap":
        call: Callable[[], Any] = lambda: pool.starmap(operator.add, ((x, x) for x in source))  # noqa: E731
    else:
        call = lambda: getattr(pool, form)(tu.ident, source)  # noqa: E731
    with pytest.raises(error):
        call()


@given(
    prefix=_items,
    take=st.integers(1, 40),
    form=st.sampled_from(["imap", "imap_unordered"]),
)
def test_imap_over_an_endless_iterable_reads_a_bounded_amount(
    pool: Any, prefix: list[int], take: int, form: str
) -> None:
    source = Source(prefix, endless=True)
    it = getattr(pool, form)(tu.ident, iter(source))
    got = [it.next(timeout=tu.T) for _ in range(take)]
    assert source.produced <= take + READ_AHEAD_PER_WORKER * pool.size()
    expected = (prefix + list(range(len(prefix), len(prefix) + take)))[:take]
    if form == "imap":
        assert got == expected
    else:
        assert len(got) == take
