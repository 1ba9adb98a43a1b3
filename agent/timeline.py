"""The local timeline: one JSON line per measurement, for reports and offline analysis.

Record kinds (``schema.to_record``): ``run`` (first line), ``step``, ``window``,
``gpu`` and ``alert``. Writes happen on the agent's thread, never the training
thread; each line is flushed so a crashed job still leaves a readable file.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Union


def _clean(obj: Any) -> Any:
    """JSON has no NaN/Infinity: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


class Timeline:
    """Append-only JSONL writer. ``path=None`` makes every call a no-op.

    Raises:
        OSError: at construction, if the file cannot be opened for appending.
    """

    def __init__(self, path: Optional[Union[str, Path]]) -> None:
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")

    def write(self, record: Dict[str, Any]) -> None:
        """Append one record (a dict with a ``kind`` key)."""
        if self._fh is None:
            return
        line = json.dumps(_clean(record), separators=(",", ":"), default=str)
        with self._lock:
            if self._fh is not None:
                self._fh.write(line + "\n")
                self._fh.flush()

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def read_timeline(path: Union[str, Path]) -> Iterator[Dict[str, Any]]:
    """Yield the records of a timeline file; a torn last line (a killed job) is skipped.

    Raises:
        OSError: if the file cannot be read.
        ValueError: if a line other than the last is not JSON (naming the line number).
    """
    with open(path, encoding="utf-8") as fh:
        lines = fh.readlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines):
                return
            raise ValueError(f"{path}:{i}: not a JSON line: {exc}") from None
