"""The self-contained HTML report of an agent timeline: ``mfuwatch report`` (:mod:`.html`) and its plotly
figures (:mod:`.figures`). Needs the ``report`` extra (plotly): ``pip install 'mfuwatch[report]'``."""

from __future__ import annotations

import importlib.util
from typing import Optional

#: The one line printed when plotly is missing.
INSTALL_HINT = "the HTML report needs plotly, which is not installed: pip install 'mfuwatch[report]'"


def missing_dependency() -> Optional[str]:
    """:data:`INSTALL_HINT` when plotly cannot be imported, else ``None``; imports nothing."""
    try:
        found = importlib.util.find_spec("plotly") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else INSTALL_HINT
