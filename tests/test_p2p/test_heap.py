"""A serving process's heap settled (`p2p.heap`): what survives is frozen out of later full
collections, and what was frozen and then dropped is still collected at the next settle."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from p2p import heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> tuple[Node, weakref.ref[Node]]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a, weakref.ref(b)


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # (the rest of the suite's collections see everything again)


def test_settle_collects_then_freezes_what_survives(unfrozen: None) -> None:
    garbage, gone = cycle()
    kept, alive = cycle()
    del garbage
    assert heap.settle() >= 0.0
    assert gone() is None  # collected on the way in
    assert alive() is not None and gc.get_freeze_count() > 0
    assert gc.is_tracked(kept)
    del kept
    gc.collect()  # a full collection skips the frozen: the cycle outlives it
    assert alive() is not None
    heap.settle()  # the next settle unfreezes first: nothing frozen is leaked for good
    assert alive() is None
