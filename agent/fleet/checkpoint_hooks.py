"""Automatic checkpoint timing: ``torch.save``/``torch.load`` and ``torch.distributed.checkpoint`` save/load.

While at least one agent with ``auto_checkpoint_phases: true`` is open, the
module attributes ``torch.save``, ``torch.load`` and — when the program has
imported ``torch.distributed.checkpoint`` before the agent started — its
``save``/``load`` (and the older ``save_state_dict``/``load_state_dict``) are
wrapped by a function that calls the original with the same arguments and
returns its result or raises its exception unchanged. Around the call, each
registered listener's ``checkpoint_enter(kind, source)`` /
``checkpoint_exit(kind, seconds, source)`` runs, where ``kind`` is ``"save"`` or
``"load"`` and ``source`` the wrapped function (``"torch.save"``); a listener's own failure is its own
business (the agent's listener counts it) and never reaches the caller.

Only calls on a listener's training thread count (a background checkpoint
thread does not stall training), and nested calls (DCP writing through
``torch.save``) count once, as the outermost. The originals are restored when
the last agent closes, if nobody replaced the wrappers meanwhile. Code that
bound ``from torch import save`` before the agent started keeps the original
function: use ``with agent.phase("checkpoint"):`` there.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Tuple

_LOCK = threading.Lock()
_listeners: List[Any] = []
_originals: Dict[Tuple[Any, str], Callable] = {}
_depth = threading.local()

#: (module name, attribute, kind) of the functions wrapped.
TARGETS = (
    ("torch", "save", "save"),
    ("torch", "load", "load"),
    ("torch.distributed.checkpoint", "save", "save"),
    ("torch.distributed.checkpoint", "load", "load"),
    ("torch.distributed.checkpoint", "save_state_dict", "save"),
    ("torch.distributed.checkpoint", "load_state_dict", "load"),
)


def _wrap(fn: Callable, kind: str, mod_name: str, attr: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_depth, "n", 0)
        if depth:
            return fn(*args, **kwargs)
        tid = threading.get_ident()
        mine = [li for li in list(_listeners) if li.owns_thread(tid)]
        if not mine:
            return fn(*args, **kwargs)
        source = f"{mod_name}.{attr}"
        for li in mine:
            li.checkpoint_enter(kind, source)
        _depth.n = 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _depth.n = 0
            dt = time.perf_counter() - t0
            for li in mine:
                li.checkpoint_exit(kind, dt, source)

    wrapper.__mfuwatch_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def install(listener: Any) -> None:
    """Register ``listener`` (an object with ``owns_thread``, ``checkpoint_enter``, ``checkpoint_exit``)."""
    with _LOCK:
        if listener not in _listeners:
            _listeners.append(listener)
        for mod_name, attr, kind in TARGETS:
            mod = sys.modules.get(mod_name)
            if mod is None or (mod, attr) in _originals:
                continue
            fn = getattr(mod, attr, None)
            if fn is None or not callable(fn) or hasattr(fn, "__mfuwatch_original__"):
                continue
            _originals[(mod, attr)] = fn
            setattr(mod, attr, _wrap(fn, kind, mod_name, attr))


def uninstall(listener: Any) -> None:
    """Unregister ``listener``; the last one out restores the original functions."""
    with _LOCK:
        if listener in _listeners:
            _listeners.remove(listener)
        if _listeners:
            return
        for (mod, attr), fn in list(_originals.items()):
            current = getattr(mod, attr, None)
            if getattr(current, "__mfuwatch_original__", None) is fn:
                setattr(mod, attr, fn)
            del _originals[(mod, attr)]
