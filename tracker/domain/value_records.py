"""Immutable value records that are cheap to build: frozen for the type checker, not at run time.

``@dataclass(frozen=True)`` makes CPython's generated ``__init__`` set every field through
``object.__setattr__`` (the class's own ``__setattr__`` refuses), which costs ~0.2 us per
field: an :class:`~tracker.domain.entries.Entry` (18 fields) took 4.1 us to build against
0.6 us for the same class unfrozen (2026-12-02, this machine). Entries are built once per
marker that reaches the store, per row an ingest flush or a claim reads and per copy a
redelivery round makes, so that was a tenth of the tracker's CPU per persisted marker.

:func:`value_record` keeps what ``frozen=True`` is for, immutability, where it is checked in
this project: mypy treats a decorated class as a frozen dataclass (PEP 681
``dataclass_transform``) and reports every assignment to a field as an error. At run time the
class is a plain slotted dataclass with the hash a frozen one has (``unsafe_hash``), so
instances still go in sets and serve as dict keys by value, and ``dataclasses.replace`` works
as before. Nothing in the project assigns to a field of one; the type check proves it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, dataclass_transform

T = TypeVar("T")


@dataclass_transform(frozen_default=True, eq_default=True)
def value_record(cls: type[T]) -> type[T]:
    """A slotted dataclass, frozen as far as the type checker is concerned (module doc)."""
    make: Callable[[type[T]], type[T]] = dataclass(slots=True, eq=True, unsafe_hash=True)
    return make(cls)
