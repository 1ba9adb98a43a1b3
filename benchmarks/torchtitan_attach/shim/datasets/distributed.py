"""``split_dataset_by_node`` of the stand-in (every ``world_size``-th record from ``rank``)."""

from . import Dataset


def split_dataset_by_node(ds, rank, world_size):
    return Dataset(ds._rows[rank::world_size])
