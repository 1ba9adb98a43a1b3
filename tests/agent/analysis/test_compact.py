"""The typed-array containers of ``analysis/compact.py`` against the Python dicts, sets and lists they replace."""

from __future__ import annotations

import random
from array import array

import numpy as np
import pytest

from mfuwatch.agent.analysis.compact import (IdSet, IntGroups, SparseColumn, first_by_key, last_by_key, lookup,
                                             np_view, to_array)


def _entries(seed: int, n: int = 2000):
    """Random (key, value) entries with many repeated keys and repeated pairs, negative keys included."""
    rng = random.Random(seed)
    return [(rng.randint(-20, 300), rng.randint(0, 50)) for _ in range(n)]


def test_sparse_column_reads_like_the_dense_array_it_replaces():
    ids, values = array("q", [2, 5, 9]), array("d", [1.5, 2.5, 3.5])
    col = SparseColumn(ids, values)
    dense = [0.0] * 12
    for i, v in zip(ids, values):
        dense[i] = v
    assert [col[i] for i in range(12)] == dense
    assert col[-1] == 0.0 and col[10 ** 9] == 0.0 and len(col) == 3
    col.values[1] += 1.0  # writes go to the value at that id's position
    assert col[5] == 3.5
    with pytest.raises(ValueError, match="3 ids but 2 values"):
        SparseColumn(ids, array("d", [1.0, 2.0]))
    assert SparseColumn(array("q"), array("d"))[0] == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int_groups_equal_a_dict_of_lists_built_in_order(seed):
    entries = _entries(seed)
    reference = {}
    for k, v in entries:
        reference.setdefault(k, []).append(v)
    g = IntGroups(np.array([k for k, _ in entries]), np.array([v for _, v in entries], dtype=np.int32))
    assert len(g) == len(reference)
    for k in range(-25, 310):
        got = g.get(k)
        assert got == reference.get(k, [])
        assert all(type(v) is int for v in got)  # Python ints, not numpy scalars


def test_int_groups_empty_and_mismatched():
    g = IntGroups(np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert len(g) == 0 and g.get(0) == []
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        IntGroups(np.array([1, 2]), np.array([3]))


def test_id_set_membership_and_bounds():
    s = IdSet(10)
    s.add(3)
    s.update([0, 9, 3])
    assert [i for i in range(-3, 14) if i in s] == [0, 3, 9]
    with pytest.raises(IndexError):
        s.add(-1)  # a bytearray would silently take -1 as the last id
    with pytest.raises(IndexError):
        s.update([4, 10])
    assert 4 in s  # the ids before the bad one were added


@pytest.mark.parametrize("seed", [3, 4])
def test_last_and_first_by_key_then_lookup_equal_dict_get(seed):
    entries = _entries(seed, 500)
    keys = np.array([k for k, _ in entries])
    values = np.array([float(v) + 0.5 for _, v in entries])
    last = dict(zip(keys.tolist(), values.tolist()))
    first = {}
    for k, v in zip(keys.tolist(), values.tolist()):
        first.setdefault(k, v)
    queries = np.arange(-30, 320)
    for got, ref in ((last_by_key(keys, values), last), (first_by_key(keys, values), first)):
        distinct, vals = got
        assert distinct.tolist() == sorted(ref)
        assert vals.tolist() == [ref[k] for k in sorted(ref)]
        out = lookup(distinct, vals, queries, float("nan"))
        assert out.dtype == np.float64
        want = [ref.get(q, float("nan")) for q in queries.tolist()]
        assert np.array_equal(out, np.array(want), equal_nan=True)


def test_lookup_on_nothing_gives_the_default():
    distinct, vals = last_by_key(np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert lookup(distinct, vals, np.array([0, 5, -1]), -1).tolist() == [-1, -1, -1]


def test_np_view_shares_memory_and_to_array_copies_once():
    a = array("q", [4, 5, 6])
    v = np_view(a, np.int64)
    v[0] = 40
    assert a[0] == 40
    with pytest.raises(BufferError):
        a.append(7)  # an exported buffer cannot be resized while the view lives
    del v
    a.append(7)
    with pytest.raises(ValueError, match="typecode 'q'"):
        np_view(a, np.int32)
    assert np_view(array("d"), np.float64).size == 0
    for x, code in ((np.array([1, -2], np.int64), "q"), (np.array([3, 4], np.int32), "i"),
                    (np.array([-1, 1], np.int8), "b"), (np.array([0.5, -2.25]), "d")):
        out = to_array(x[::-1])  # a strided (non-contiguous) view
        assert out.typecode == code and out.tolist() == x[::-1].tolist()
