"""Preemption: close the agent on SIGTERM (and the other configured warning signals), then hand the signal on.

Slurm (time limit, preemption, ``scancel``), Kubernetes (pod deletion), torchrun (a failed peer)
and most batch systems send SIGTERM, wait a grace period (Slurm's ``KillWait`` 30 s, Kubernetes'
``terminationGracePeriodSeconds`` 30 s) and then SIGKILL. Without a handler, Python dies at once
with status -15: the last report interval, the records the timeline holds for ordering, the
resolved notifications of firing alerts and the file-SD target's removal are lost.

:func:`install` sets one handler per signal. When the signal arrives it

1. records it (``record_fn(signal_name)``: the agent writes a ``signal`` timeline record and counts
   ``mfuwatch_signals_total{signal}``);
2. runs ``close_fn(reason)`` on a helper thread and waits for it at most ``timeout_s`` seconds (the
   helper thread keeps a close that blocks on a lock the interrupted main thread holds from
   blocking the signal: past the bound it is abandoned, a daemon thread);
3. puts the previous handlers back (where nobody replaced this one since) and hands the signal on:
   a Python callable (the user's, HF Trainer's, Lightning's, torchelastic's) is called with
   ``(signum, frame)``; the default action is re-raised with the default disposition, so the process
   ends exactly as it would have without the agent (status -15 for SIGTERM).

A signal of ``signals`` that arrives while that close runs (``scancel`` signalling both the batch
shell and the job step, torchrun forwarding, a second ``kill``) does not cut the close short: the
handler notes it and returns, the close goes on within the same ``timeout_s``, and the noted signal
is re-raised (``signal.raise_signal``) once the first one was handed on and its handler returned.
Each signal number is noted once however often it repeats (as CPython coalesces a signal that
arrives again before its handler ran). So with the default action the process dies by the first
signal after the close (-15, 143 in a shell); a Python handler that returns (one that sets a
"stop soon" flag) sees the repeat as it would have without the agent; one that ends the process
(``sys.exit``, torchelastic's ``SignalException``) runs once. An exception raised meanwhile by
another signal's handler (``KeyboardInterrupt`` for a Ctrl-C) is kept until the close ended and the
first signal was handed on, then raised.

The close happens at the signal, before a previous handler runs: a job whose own handler only sets a
"stop soon" flag, steps on and checkpoints loses those last steps from the agent's figures. Such a job
sets ``preemption_signals: []`` and calls ``agent.close(reason=..., budget_s=...)`` after its checkpoint
(docs/reliability.md, "A graceful stop handler").

A signal whose disposition is ``SIG_IGN`` (``nohup`` sets it for SIGHUP) or was set outside Python
is left alone. Handlers can only be set from the main thread (CPython's rule): from another thread
:func:`install` does nothing. A forked child (``os.fork``) hands every signal straight on.

Limitation: CPython runs a Python-level handler on the main thread between bytecodes, so a main
thread blocked in one long C call (a hung NCCL collective) runs it only when the call returns; the
scheduler's SIGKILL still ends the job then.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional

log = logging.getLogger("mfuwatch")


def install(close_fn: Callable[[str], None], timeout_s: float, record_fn: Optional[Callable[[str], None]] = None,
            signals: Iterable[str] = ("SIGTERM",)) -> Callable[[], None]:
    """Install the handler of the module docstring for each of ``signals``; return the uninstall function.

    Args:
        close_fn: called once, on a helper thread, with the reason (``"run preempted (SIGTERM)"``).
        timeout_s: seconds the handler waits for ``close_fn`` before it hands the signal on.
        record_fn: called with the signal name (``"SIGTERM"``) before ``close_fn``; may be ``None``.
        signals: signal names (``signal.Signals`` members); unknown names on this platform are skipped.

    Returns:
        ``uninstall()``: idempotent; restores the previous handler of every signal whose current handler
        is still this one (a handler installed later by someone else stays) and makes this one pass
        signals straight on. Never raises.
    """
    if threading.current_thread() is not threading.main_thread():
        log.debug("mfuwatch: not on the main thread: no preemption signal handler (CPython allows them only there)")
        return lambda: None
    pid = os.getpid()
    previous: Dict[int, object] = {}
    state = {"active": True, "phase": "idle"}  # phase: idle -> closing (the first signal's close) -> done
    repeats: List[int] = []  # signals that came again during the close, in order, each once

    def uninstall() -> None:
        state["active"] = False
        for signum, prev in list(previous.items()):
            try:
                if signal.getsignal(signum) is handler:
                    signal.signal(signum, prev)
            except (ValueError, TypeError, OSError):  # not the main thread, interpreter shutting down
                pass

    def pass_on(signum: int, frame) -> None:
        prev = previous.get(signum, signal.SIG_DFL)
        if callable(prev):
            prev(signum, frame)
            return
        if prev == signal.SIG_IGN:
            return
        # the default action, as if the agent had never been there: termination by this signal
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    def handler(signum: int, frame) -> None:
        # No lock: handlers run on the main thread only, and one may interrupt another there (a blocking lock
        # taken by both would deadlock); each test below reads, and each change writes, one dict item.
        name = signal.Signals(signum).name
        if state["phase"] == "closing" and os.getpid() == pid:
            if signum not in repeats:  # a repeat during the close: raised again after it (module docstring)
                repeats.append(signum)
            return
        if not (state["active"] and state["phase"] == "idle" and os.getpid() == pid):
            pass_on(signum, frame)
            return
        state["phase"] = "closing"
        if record_fn is not None:
            try:
                record_fn(name)
            except Exception:  # noqa: BLE001 - recording must not stop the close nor the hand-on
                pass
        done = threading.Event()

        def run() -> None:
            try:
                close_fn(f"run preempted ({name})")
            except Exception as exc:  # noqa: BLE001
                log.warning("mfuwatch: closing on %s failed (%s: %s)", name, type(exc).__name__, exc)
            finally:
                done.set()

        t = threading.Thread(target=run, name="mfuwatch-preempt", daemon=True)
        t.start()
        deadline = time.monotonic() + timeout_s
        raised: Optional[BaseException] = None
        while True:
            try:
                if not done.wait(max(0.0, deadline - time.monotonic())):
                    log.warning("mfuwatch: closing on %s did not finish within %.1f s; handing the signal on",
                                name, timeout_s)
                break
            except BaseException as exc:  # noqa: BLE001 - another signal's handler raised (Ctrl-C): kept
                raised = raised or exc
        state["phase"] = "done"  # a signal from here on goes straight to pass_on
        again = list(repeats)
        uninstall()
        pass_on(signum, frame)
        for sig in again:  # the first one's handler returned (a default action would have ended the process)
            try:
                signal.raise_signal(sig)
            except (ValueError, OSError):
                pass
        if raised is not None:
            raise raised

    for name in signals:
        signum = getattr(signal, name, None)
        if signum is None:
            continue
        try:
            prev = signal.getsignal(signum)
        except (ValueError, OSError):
            continue
        if prev is None or prev == signal.SIG_IGN:  # set outside Python, or ignored: leave it as it is
            continue
        try:
            signal.signal(signum, handler)
        except (ValueError, OSError):
            continue
        previous[signum] = prev
    return uninstall


def attach(agent) -> Callable[[], None]:
    """Install the preemption handler of an :class:`~mfuwatch.agent.core.Agent` from its config.

    Uses ``agent.config.preemption_signals`` / ``preemption_timeout_seconds``; the record is a ``signal``
    timeline record (``signal``, ``timestamp``, ``step``) and one count of
    ``mfuwatch_signals_total{signal}`` on ``agent.registry``; the close is
    ``agent.close(reason=..., budget_s=timeout)``. Returns the uninstall function.
    """
    import time

    from prometheus_client import Counter

    from ..schema import M

    cfg = agent.config
    if not cfg.preemption_signals:
        return lambda: None
    counter = Counter(M.SIGNALS_TOTAL.removesuffix("_total"), "Signals the agent closed on (preemption warnings)",
                      ["run", "rank", "signal"], registry=agent.registry)
    base = (agent.run_info.run, str(agent.run_info.rank))
    timeout = cfg.preemption_timeout_seconds

    def record(name: str) -> None:
        counter.labels(*base, name).inc()
        agent.reporter.write({"kind": "signal", "signal": name, "timestamp": time.time(),
                              "step": agent.hooks.step if agent.hooks is not None else 0})
        agent.exporter.refresh(force=True)  # the count reaches a scrape during the close

    def close(reason: str) -> None:
        agent.close(reason=reason, budget_s=timeout * 0.9)

    return install(close, timeout, record, cfg.preemption_signals)
