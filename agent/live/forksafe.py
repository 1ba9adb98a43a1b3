"""Fork safety: a child forked after an agent started inherits an inert copy of it.

``os.fork()`` copies the process but only the calling thread: the child has the agent's objects
without the agent's threads (exporter loop, agent thread, alert workers). Closing that copy at
the child's exit waited forever for threads that exist only in the parent (issue #28), and would
have written the parent's held timeline records and sent its notifications a second time.

:func:`protect` registers a callback run in every child right after the fork
(``os.register_at_fork(after_in_child=...)``): it makes the agent inert — marked closed, so
neither ``atexit`` nor ``__del__`` nor ``close()`` does anything; its copies of the exporter's
sockets closed without touching the parent's server. Fork-server and spawn start methods
(DataLoader workers with ``multiprocessing_context="spawn"``, torchrun) start a fresh interpreter and
never see the agent.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable, List

_lock = threading.Lock()
_callbacks: List[Callable[[], None]] = []
_registered = False


def _after_in_child() -> None:
    callbacks, _callbacks[:] = list(_callbacks), []  # the child's own agents register anew
    for fn in callbacks:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a child must start whatever the agent's state
            pass


def protect(make_inert: Callable[[], None]) -> Callable[[], None]:
    """Call ``make_inert`` in a child process right after each ``os.fork()`` (held strongly: let it hold
    its agent weakly, as :func:`protect_agent` does). Returns ``unprotect()`` (idempotent)."""
    global _registered
    with _lock:
        if not _registered and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_in_child)
            _registered = True
        _callbacks.append(make_inert)

    def unprotect() -> None:
        with _lock:
            try:
                _callbacks.remove(make_inert)
            except ValueError:
                pass

    return unprotect


def protect_agent(agent: Any, live_agents: Any) -> Callable[[], None]:
    """:func:`protect` for an :class:`~mfuwatch.agent.core.Agent`: in the child it is marked closed and
    removed from ``live_agents`` (the set the ``atexit`` close walks), its exporter forgets its sockets,
    and its file-SD target's ``atexit`` removal (of the parent's file) is cancelled. The agent is held weakly."""
    import atexit

    ref = weakref.ref(agent)

    def make_inert() -> None:
        a = ref()
        if a is None:
            return
        a._closed = True
        live_agents.discard(a)
        a.exporter.forget_after_fork()
        target = getattr(a, "_sd_target", None)
        if target is not None:
            atexit.unregister(target.remove)
            a._sd_target = None

    return protect(make_inert)
