"""Compact containers for per-op data of a big trace: typed arrays instead of Python lists and dicts.

A 1 GB profiler trace holds ~1.5 M CPU ops. A Python ``int`` in a list costs 36 bytes (8 for the pointer,
28 for the object), a dict of lists ~100 bytes per entry; the same data in an ``array("q")`` costs 8. The
:class:`~mfuwatch.agent.analysis.trace.TraceIndex` keeps its columns in :mod:`array` arrays for that reason;
the containers here let :mod:`.suggest` keep its per-op context the same way (docs/reliability.md, "Where
``analyze``'s memory goes").

* :class:`SparseColumn`: float64 values of a few op ids, read like a dense array indexed by op id.
* :class:`IntGroups`: a read-only multimap from int keys to int values (CSR layout: sorted keys, offsets,
  values).
* :class:`IdSet`: a set of ids in ``range(n)``, one byte per possible id.
* :func:`np_view` / :func:`to_array`: zero-copy numpy views of :mod:`array` arrays and back (one copy).
* :func:`last_by_key` / :func:`first_by_key` / :func:`lookup`: what ``dict(zip(keys, values))`` and
  ``d.get(key, default)`` do, on sorted numpy arrays (8 + 8 bytes per key instead of ~100).

Values read from these containers are Python ``int`` / ``float`` (never numpy scalars), so code that puts
them in sets or dict keys behaves as with lists.
"""

from __future__ import annotations

import bisect
from array import array
from typing import TYPE_CHECKING, Iterable, List

if TYPE_CHECKING:
    import numpy as np  # imported where used: importing this module costs no numpy import

#: :mod:`array` typecode of a numpy dtype, by (kind, itemsize)
_TYPECODES = {("i", 8): "q", ("i", 4): "i", ("i", 1): "b", ("f", 8): "d"}


def np_view(a: array, dtype) -> np.ndarray:
    """A numpy view (no copy; writing to it writes ``a``) of the :mod:`array` ``a``, whose item type must match
    ``dtype`` (``"q"`` ↔ int64, ``"i"`` ↔ int32, ``"b"`` ↔ int8, ``"d"`` ↔ float64). While the view lives,
    ``a`` cannot grow (``BufferError``). An empty ``a`` gives a new empty array.

    Raises:
        ValueError: the item sizes differ (a typecode that does not match ``dtype``).
    """
    import numpy as np

    dtype = np.dtype(dtype)
    if a.itemsize != dtype.itemsize:
        raise ValueError(f"array of typecode {a.typecode!r} viewed as {dtype}")
    return np.frombuffer(a, dtype=dtype) if len(a) else np.zeros(0, dtype)


def to_array(x: np.ndarray) -> array:
    """A copy of the 1-D numpy array ``x`` (int64, int32, int8 or float64) as an :mod:`array` array of the same
    item type, made in one copy (``frombytes`` reads the numpy buffer; no ``bytes`` object in between).

    Raises:
        KeyError: another dtype.
    """
    import numpy as np

    out = array(_TYPECODES[x.dtype.kind, x.dtype.itemsize])
    out.frombytes(memoryview(np.ascontiguousarray(x)).cast("B"))
    return out


class SparseColumn:
    """Float64 values of a few op ids, read like a dense array indexed by op id: ``col[op]``, 0.0 for an id
    that is not held.

    Args:
        ids: the ids held, ascending and distinct (``array("q")``; several columns may share one).
        values: one float64 per id, parallel to ``ids`` (``array("d")``; writable: ``col.values[p] += x``
            for the id at position ``p``).

    A read is a binary search, O(log len(ids)); memory is 16 bytes per id held (8 when ``ids`` is
    shared), against 8 bytes per op of the trace for a dense ``array("d")``.
    """

    __slots__ = ("ids", "values")

    def __init__(self, ids: array, values: array) -> None:
        if len(ids) != len(values):
            raise ValueError(f"{len(ids)} ids but {len(values)} values")
        self.ids, self.values = ids, values

    def __getitem__(self, op: int) -> float:
        i = bisect.bisect_left(self.ids, op)
        if i < len(self.ids) and self.ids[i] == op:
            return self.values[i]
        return 0.0

    def __len__(self) -> int:
        return len(self.ids)


class IntGroups:
    """A read-only multimap from int keys to int values, held in three ``array("q")`` arrays (CSR layout).

    Built from the entries ``(keys[e], values[e])`` in the order given (any key order); :meth:`get`
    returns a key's values in that order, repeats included. Memory: 8 bytes per value and 16 per distinct
    key, against ~100 bytes per entry for a dict of lists of ints.

    Args:
        keys, values: parallel 1-D integer numpy arrays (int64 or narrower; one entry each).

    Raises:
        ValueError: ``keys`` and ``values`` differ in length.
    """

    __slots__ = ("_keys", "_start", "_values")

    def __init__(self, keys: np.ndarray, values: np.ndarray) -> None:
        import numpy as np

        keys, values = np.asarray(keys, dtype=np.int64), np.asarray(values, dtype=np.int64)
        if keys.shape != values.shape:
            raise ValueError(f"{keys.size} keys but {values.size} values")
        order = np.argsort(keys, kind="stable")  # grouped by key, each group in the order given
        sorted_keys = keys[order]
        distinct, start = np.unique(sorted_keys, return_index=True)  # first position of each key
        self._keys = to_array(distinct)
        self._start = to_array(np.append(start, sorted_keys.size).astype(np.int64))
        self._values = to_array(values[order])

    def get(self, key: int) -> List[int]:
        """The values entered with ``key``, in the order given (``[]`` for a key never entered)."""
        i = bisect.bisect_left(self._keys, key)
        if i == len(self._keys) or self._keys[i] != key:
            return []
        return self._values[self._start[i]:self._start[i + 1]].tolist()

    def __len__(self) -> int:
        """Number of distinct keys."""
        return len(self._keys)


class IdSet:
    """A set of ids in ``range(n)``, one byte per possible id: ``i in s``, :meth:`add`, :meth:`update` (what the
    pattern matchers ask of a ``set`` of op ids).

    Memory is ``n`` bytes whatever the number of members, against ~60 bytes per member for a ``set`` of
    ints (its table slot and the ``int`` object). An id outside ``range(n)`` is never a member.

    Args:
        n: number of possible ids (e.g. the trace's ops, ``len(index.op_ts)``).
    """

    __slots__ = ("_flags",)

    def __init__(self, n: int) -> None:
        self._flags = bytearray(n)

    def __contains__(self, i: int) -> bool:
        return 0 <= i < len(self._flags) and self._flags[i] == 1

    def add(self, i: int) -> None:
        """Add ``i``; IndexError when it is outside ``range(n)``."""
        if i < 0:
            raise IndexError(f"id {i} outside range({len(self._flags)})")
        self._flags[i] = 1

    def update(self, ids: Iterable[int]) -> None:
        """Add every id of ``ids``; IndexError at the first one outside ``range(n)``."""
        for i in ids:
            self.add(i)


def _runs(keys: np.ndarray):
    """``keys`` (1-D int64) sorted stably: (order, first position, last position of each run of one key in
    ``keys[order]``)."""
    import numpy as np

    order = np.argsort(keys, kind="stable")
    if not keys.size:
        return order, order, order
    sorted_keys = keys[order]
    change = np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1  # where a new key begins
    return order, np.concatenate(([0], change)), np.concatenate((change - 1, [keys.size - 1]))


def last_by_key(keys: np.ndarray, values: np.ndarray):
    """The distinct ``keys`` (ascending) and, for each, the value of its last entry: ``dict(zip(keys, values))``
    as two arrays (``keys``, ``values``: parallel 1-D numpy arrays, ``keys`` integer).

    Returns:
        ``(distinct keys, values)``: int64 and ``values``' dtype, one entry per distinct key, for :func:`lookup`.
    """
    import numpy as np

    keys = np.asarray(keys, dtype=np.int64)
    order, _, last = _runs(keys)
    return keys[order[last]], np.asarray(values)[order[last]]


def first_by_key(keys: np.ndarray, values: np.ndarray):
    """As :func:`last_by_key`, with each key's first entry's value (``d.setdefault(key, value)`` in order)."""
    import numpy as np

    keys = np.asarray(keys, dtype=np.int64)
    order, first, _ = _runs(keys)
    return keys[order[first]], np.asarray(values)[order[first]]


def lookup(distinct_keys: np.ndarray, values: np.ndarray, queries: np.ndarray, default) -> np.ndarray:
    """``[d.get(q, default) for q in queries]`` for the ``d`` that :func:`last_by_key` / :func:`first_by_key`
    returned as ``(distinct_keys, values)``; a 1-D array of ``values``' dtype, one entry per query."""
    import numpy as np

    queries = np.asarray(queries, dtype=np.int64)
    out = np.full(queries.size, default, dtype=values.dtype)
    if not distinct_keys.size:
        return out
    pos = np.searchsorted(distinct_keys, queries)
    np.minimum(pos, distinct_keys.size - 1, out=pos)
    hit = distinct_keys[pos] == queries
    out[hit] = values[pos[hit]]
    return out
