"""A stand-in for the few names torchtitan's text datasets take from Hugging Face ``datasets``.

Only for the torchtitan validation run (benchmarks/torchtitan_attach/README.md): the GPU machine has no
registry and ``datasets`` with pyarrow and pandas does not fit in what a run may carry. It reads the
JSON-lines files of a local folder (torchtitan's ``tests/assets/c4_test``) into a list of dicts.
"""

import json
import os


class Dataset:
    """A list of records with the two methods torchtitan's HuggingFaceTextDataset calls."""

    def __init__(self, rows):
        self._rows = list(rows)

    def __len__(self):
        return len(self._rows)

    def __iter__(self):
        return iter(self._rows)

    def __getitem__(self, i):
        return self._rows[i]

    def skip(self, n):
        return Dataset(self._rows[n:])


def load_dataset(path, split="train", **_):
    rows = []
    files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith((".json", ".jsonl"))]
    for f in files:
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if line:
                    rows.append(json.loads(line))
    return Dataset(rows)
