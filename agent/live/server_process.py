"""The exporter's server in a child process: a scrape costs the training process no interpreter time.

Why a process (issue #28): the in-process server (:mod:`.http_server`, ``exporter_server: thread``) is
one event-loop thread, but every request it answers takes the interpreter lock (GIL) the training
thread needs to launch kernels; with a launch-bound step each handover costs the training thread a
switch interval and a context switch. Here the training process only *renders* the exposition
(prometheus-client's ``generate_latest`` on its registry) and a child process owns the listening
socket and runs the same :class:`~.http_server.MetricsServer` loop (TLS handshakes off the accept
path with timeouts, the connection cap, ``/metrics`` only, ``name[]`` filtering on the bytes,
bearer/basic auth, the CPU-share bucket), so no request ever runs Python in the training process.

Design (the choices, and why):

* **Started with** ``subprocess`` (``sys.executable -m mfuwatch.agent.live.server_process``), never
  ``fork``: CUDA (and NCCL, and the agent's own threads) may be initialised in the parent, and a forked
  copy of such a process is unsafe. The child imports the standard library and :mod:`.http_server` only
  (no torch, no prometheus-client: from spawn to its port answer 0.13-0.16 s on the shared 2-core CPU
  machine), with ``MFUWATCH_DISABLE=1`` so that ``mfuwatch run``'s bootstrap never attaches an agent
  to it. It runs at ``nice +10`` and inherits the parent's CPU affinity, unless ``cpus`` (the
  ``exporter_server_cpus`` setting) names others: the child applies them to itself before it starts
  its loop thread, so that every thread of it runs there (an affinity set from outside on the child's
  pid moves its main thread only; the loop thread, which does all the serving, would stay put). Where it
  shares a core with the training thread, the scheduler favours training, but its loop still takes up
  to ``exporter_max_cpu_share`` of that core and preempts the training thread at each wake-up (on the
  H200, 10 scrapers as fast as they can cost a launch-bound step +5.5% this way, 95% CI +3.5..+8.2%, and
  +0.5% with the child on another core: docs/gpu-runs/scrape_load-run4.md); a job pinned to few cores
  should name another one here.
* **Settings, secrets included, over its stdin pipe** (one JSON frame; never ``argv`` or the
  environment, which other users can read in ``/proc``). The child binds (``port`` 0 works; a busy port
  tries the next ones, as the thread server does) and answers one line on its stdout, ``port N`` or
  ``error ERRNO MESSAGE``.
* **New bytes through an atomically replaced file** in a private directory (``mkdtemp``, mode 0700):
  the parent writes ``body.tmp``, ``os.replace``\\ s it over ``body`` and sends a 9-byte frame (under
  ``PIPE_BUF``: written whole or not at all by a non-blocking write). A child that stops reading can
  therefore never block a thread of the training process, and a frame that does not fit is sent later.
* **Renders happen in the parent's publisher thread** (one daemon thread, never the training thread):
  when the child asks (a scrape found its bytes older than ``exporter_render_interval_seconds``: the
  request is parked up to ``max_wait_s`` for fresh bytes, so a scrape sees data at most one interval old
  however rarely it comes, and a job nobody scrapes renders nothing); after a report when a scrape read
  the previous bytes (at most two per interval this way); and at once after an event (a notification
  outcome, a preemption signal) and at :meth:`ProcessServer.close` (a final render before the server
  stops).
* **Self-monitoring back over its stdout**: ``read V`` (a scrape served version V), ``want`` (fresh bytes
  wanted), and ``stats {json}`` (requests by status, dropped connections by reason, the child's
  CPU seconds, the seconds its loop slept for the CPU cap) at most once a second when they changed; the
  exporter serves them as ``mfuwatch_exporter_*`` series (:mod:`.exporter`). ``affinity ERRNO MESSAGE``
  once at start when the kernel refused ``cpus`` (counted and logged once by the parent; the child
  serves on with the inherited affinity). The parent counts what crosses the pipes
  (:attr:`ProcessServer.lines_received`, :attr:`~ProcessServer.frames_sent`,
  :attr:`~ProcessServer.wakeups`) so that a benchmark can tell how often serving wakes the training
  process.
* **No orphan**: the child exits when its stdin reaches EOF, which happens when the parent closes it
  (:meth:`ProcessServer.close`) or dies in any way, SIGKILL included (the kernel closes the parent's
  descriptors). It ignores SIGINT, SIGTERM, SIGHUP, SIGUSR1/2 (a signal sent to the whole process group
  must not stop the server before the parent's preemption close has rendered its last bytes). A child
  forked from the training process after start closes its copy of the pipe (:func:`.forksafe.protect`),
  so a lingering DataLoader worker does not keep the server alive past its parent.
* A child that dies (killed, out of memory) is counted (``agent_errors_total{component="exporter"}``) and
  replaced on the same port, at most :data:`MAX_RESTARTS` times.
* :meth:`ProcessServer.close` returns within its timeout: the final render is waited for at most half of
  it; then stdin is closed and the child waited for; past the bound it is killed.

If the child cannot start (no ``python`` to run, an import error, no answer within
``start_timeout_s``), :meth:`ProcessServer.start` raises :class:`ChildUnavailable`; the exporter then
falls back to the in-process thread server, counted as ``agent_errors_total{component="exporter_process"}``
and logged once.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple

log = logging.getLogger("mfuwatch")

#: parent -> child frames: 1 byte kind, 4 bytes big-endian payload length, payload
_FRAME = struct.Struct(">cI")
#: seconds a scrape that found stale bytes waits for fresh ones before it is served what there is
MAX_WAIT_S = 0.5
#: the child's self-monitoring line goes at most this often (when something changed)
STATS_EVERY_S = 1.0
#: times a server child that died is replaced (1, 2, 4 s after it died) before /metrics stays down
MAX_RESTARTS = 3
#: signals the server child ignores: it ends when its stdin reaches EOF (see the module docstring)
_IGNORED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")


def _readable(fds, timeout: float) -> list:
    """The descriptors of ``fds`` readable (or at EOF) within ``timeout`` seconds. ``poll``, not ``select``:
    a training process can hold descriptors numbered past select's 1024."""
    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return [fd for fd, _ev in p.poll(max(0.0, timeout) * 1000.0)]


class ChildUnavailable(RuntimeError):
    """The server child could not be started or did not answer (the exporter falls back to the thread server)."""


# ============================================================================== the child process
class PushedExposition:
    """The child's source of bytes for :class:`~.http_server.MetricsServer`: the last bytes the parent pushed.

    ``wants_fresh(ask=True)`` tells the loop how long a request should wait for fresher bytes (0: serve
    now): bytes older than ``min_interval_s`` are stale, the parent is asked once (``on_ask``) and the
    request parked up to ``max_wait_s``; a parent that does not answer is asked again only after
    another ``min_interval_s`` (requests meanwhile are served what there is).
    """

    def __init__(self, min_interval_s: float, on_ask: Callable[[], None], on_read: Callable[[int], None],
                 max_wait_s: float = MAX_WAIT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.min_interval_s = float(min_interval_s)
        self.max_wait_s = float(max_wait_s)
        self._on_ask, self._on_read, self._clock = on_ask, on_read, clock
        self._lock = threading.Lock()
        self._body, self._gz = b"", None
        self._at: Optional[float] = None
        self._asked_at: Optional[float] = None
        self.version = 0
        self._read_version = -1

    def push(self, body: bytes, version: int, fresh: bool = True) -> None:
        """New bytes from the parent (the main thread, after reading the body file). ``fresh=False``: the
        start-up render, served only when the parent does not answer (the first scrape asks for a render,
        as the first scrape of the thread server renders)."""
        with self._lock:
            self._body, self._gz, self.version = body, None, version
            self._at, self._asked_at = (self._clock() if fresh else None), None

    def wants_fresh(self, ask: bool = True) -> float:
        with self._lock:
            now = self._clock()
            if self._at is not None and now - self._at < self.min_interval_s:
                return 0.0
            if self._asked_at is not None and now - self._asked_at > self.max_wait_s + self.min_interval_s:
                self._asked_at = None  # the parent did not answer: ask again
            if self._asked_at is None:
                if not ask:
                    return 0.0
                self._asked_at = now
                self._on_ask()
            return max(0.0, self._asked_at + self.max_wait_s - now)

    def get(self, gzipped: bool = False) -> bytes:
        import gzip

        with self._lock:
            if self._read_version != self.version:
                self._read_version = self.version
                self._on_read(self.version)
            if not gzipped:
                return self._body
            if self._gz is None:
                self._gz = gzip.compress(self._body, compresslevel=1)
            return self._gz


def _child_main() -> int:
    """``python -m mfuwatch.agent.live.server_process``: read the settings frame, bind, serve until stdin's EOF."""
    for name in _IGNORED:
        try:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        except (AttributeError, OSError, ValueError):
            pass
    try:
        os.nice(10)
    except (AttributeError, OSError):
        pass
    out_lock = threading.Lock()
    out_fd = sys.stdout.fileno()
    os.set_blocking(out_fd, False)  # a parent that stops reading must never stall the server loop

    def say(line: str) -> None:
        """One line to the parent; a line under PIPE_BUF is written whole or, on a full pipe, dropped."""
        with out_lock:
            try:
                os.write(out_fd, (line[:3000] + "\n").encode())
            except OSError:  # a full pipe (dropped) or the parent is gone (EOF on stdin follows)
                pass

    in_fd = sys.stdin.fileno()
    buf = b""

    def frames():
        """Complete frames in ``buf`` (kind, payload); the rest stays in ``buf``."""
        nonlocal buf
        while len(buf) >= _FRAME.size:
            kind, n = _FRAME.unpack_from(buf)
            if len(buf) < _FRAME.size + n:
                return
            payload = buf[_FRAME.size:_FRAME.size + n]
            buf = buf[_FRAME.size + n:]
            yield kind, payload

    # the settings frame first (blocking reads)
    cfg = None
    while cfg is None:
        data = os.read(in_fd, 65536)
        if not data:
            return 0
        buf += data
        for kind, payload in frames():
            if kind == b"C":
                cfg = json.loads(payload.decode())
                break
    affinity_error = None
    if cfg.get("cpus"):
        try:  # before any thread starts: every thread of this process inherits it
            os.sched_setaffinity(0, set(cfg["cpus"]))
        except (AttributeError, OSError, ValueError) as exc:
            affinity_error = (getattr(exc, "errno", None) or 0, f"cpus {cfg['cpus']}: {exc}")
    from .http_server import Auth, MetricsServer

    body_path = os.path.join(cfg["dir"], "body")
    read_seen = threading.Event()
    reads = [None]

    def on_read(v: int) -> None:
        reads[0] = v
        read_seen.set()  # wakes nothing itself: the main loop below polls every 0.05 s

    src = PushedExposition(cfg["min_interval_s"], on_ask=lambda: say("want"), on_read=on_read,
                           max_wait_s=cfg.get("max_wait_s", MAX_WAIT_S))
    try:
        with open(body_path, "rb") as f:
            src.push(f.read(), 0, fresh=False)
    except OSError:
        pass
    ctx = None
    if cfg.get("certfile"):
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cfg["certfile"], cfg.get("keyfile") or None)
    auth = Auth(cfg["auth"][0], cfg["auth"][1].encode("latin-1")) if cfg.get("auth") else None
    server = None
    port = int(cfg["port"])
    candidates = [0] if port == 0 else range(port, min(port + int(cfg.get("tries", 1)), 65536))
    last_err: Optional[OSError] = None
    for p in candidates:
        s = MetricsServer(src, cfg["host"], p, ssl_context=ctx, auth=auth, max_connections=cfg["max_connections"],
                          read_timeout_s=cfg["read_timeout_s"], handshake_timeout_s=cfg["handshake_timeout_s"],
                          max_cpu_share=cfg["max_cpu_share"])
        try:
            s.start()
        except OSError as exc:
            last_err = exc
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                break
            continue
        server = s
        break
    if server is None:
        e = last_err.errno if last_err is not None and last_err.errno else 0
        say(f"error {e} {(last_err.strerror if last_err is not None else None) or last_err}")
        return 1
    say(f"port {server.server_address[1]}")
    if affinity_error is not None:
        say(f"affinity {affinity_error[0]} {affinity_error[1]}")
    last_stats, last_sent = None, 0.0
    try:
        while True:
            if _readable([in_fd], 0.05):
                data = os.read(in_fd, 65536)
                if not data:  # EOF: the parent closed the pipe or died
                    break
                buf += data
                newest = None
                for kind, payload in frames():
                    if kind == b"B":
                        newest = struct.unpack(">Q", payload)[0]
                if newest is not None:
                    try:
                        with open(body_path, "rb") as f:
                            src.push(f.read(), newest)
                        server.wake()  # parked requests are answered with these bytes
                    except OSError:
                        pass
            if read_seen.is_set():
                read_seen.clear()
                if reads[0] is not None:
                    say(f"read {reads[0]}")
            now = time.monotonic()
            if now - last_sent >= STATS_EVERY_S:
                st = server.stats()
                st["cpu_seconds"] = time.process_time()  # the whole child, not only its loop thread
                if st != last_stats:
                    say("stats " + json.dumps(st))
                    last_stats, last_sent = st, now
    finally:
        server.close(1.0)
        shutil.rmtree(cfg["dir"], ignore_errors=True)
    return 0


# ============================================================================== the parent side
class ProcessServer:
    """The training process's end of the server child: spawns it, publishes renders, reads its counters.

    Args:
        render: returns the exposition bytes (``lambda: generate_latest(registry)``); called on the
            publisher thread only (and once by :meth:`start`, on the caller's thread).
        host, port, tries: where the child listens (``port=0``: any free port; a busy ``port``: the next
            ones, ``tries`` in all).
        certfile, keyfile: TLS (the child loads them; the caller has checked they load).
        auth: an :class:`~.http_server.Auth` or ``None`` (its expected header goes to the child over stdin).
        min_interval_s, max_connections, read_timeout_s, handshake_timeout_s, max_cpu_share: as for
            :class:`~.http_server.MetricsServer` and :class:`~.http_server.ExpositionCache`.
        on_error: told ``("exporter", exc)`` of a failing render or a child that died.
        start_timeout_s: the child must answer its port within this (else :class:`ChildUnavailable`).
        cpus: CPU numbers the child (every thread of it) runs on; ``None``: this process's affinity. A set
            the kernel refuses is reported to ``on_error`` as an ``OSError`` and the child keeps the
            inherited affinity.
        python: the interpreter to run (default ``sys.executable``).

    Raises:
        ChildUnavailable: from :meth:`start`, when the child cannot be started or does not answer.
        OSError: from :meth:`start`, when the child cannot bind any port of the range (as the thread server).
    """

    def __init__(self, render: Callable[[], bytes], host: str, port: int, *, tries: int = 1,
                 certfile: Optional[str] = None, keyfile: Optional[str] = None, auth: Any = None,
                 min_interval_s: float = 0.5, max_connections: int = 256, read_timeout_s: float = 10.0,
                 handshake_timeout_s: float = 5.0, max_cpu_share: float = 0.03,
                 on_error: Optional[Callable[[str, BaseException], None]] = None,
                 start_timeout_s: float = 10.0, python: Optional[str] = None, cpus: Optional[Any] = None) -> None:
        self._render = render
        self.host, self.port, self.tries = host, int(port), int(tries)
        self.min_interval_s = float(min_interval_s)
        self.on_error = on_error
        self.start_timeout_s = float(start_timeout_s)
        self.python = python or sys.executable
        self._settings = {
            "host": host, "port": int(port), "tries": int(tries), "certfile": certfile or "", "keyfile": keyfile or "",
            "auth": [auth.scheme, auth._expected.decode("latin-1")] if auth is not None else None,
            "min_interval_s": self.min_interval_s, "max_wait_s": MAX_WAIT_S, "max_connections": int(max_connections),
            "read_timeout_s": float(read_timeout_s), "handshake_timeout_s": float(handshake_timeout_s),
            "max_cpu_share": float(max_cpu_share), "cpus": sorted(int(c) for c in cpus) if cpus else None,
        }
        self.proc: Optional[subprocess.Popen] = None
        self._dir: Optional[str] = None
        self._bound: Optional[Tuple[str, int]] = None
        self._lock = threading.Lock()
        self._pub_lock = threading.Lock()  # one render + file replace + frame at a time
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._wake_r = self._wake_w = -1
        # what the publisher thread acts on (set by any thread, under _lock)
        self._force = False
        self._if_read = False
        self._want = False
        self._final_done = threading.Event()
        self._final_wanted = False
        # state of the published bytes
        self.version = 0
        self._read_version = -1
        self._rendered_at: Optional[float] = None
        self._unsent = False
        self.renders = 0
        #: CPU seconds the publisher thread spent rendering (the training process's whole share of the
        #: interpreter lock for serving /metrics in this mode), for benchmarks/scrape_load.py
        self.render_seconds = 0.0
        self._stats: Dict[str, Any] = {"answered": {}, "dropped": {}, "cpu_seconds": 0.0, "throttled_seconds": 0.0}
        self._died_reported = False
        #: server children started again after one died (at most :data:`MAX_RESTARTS`)
        self.restarts = 0
        #: lines read from the child by kind (``read``, ``want``, ``stats``, ``affinity``), frames of new
        #: bytes sent to it, and times the publisher thread woke up (a line, a poke or its 0.5 s timeout):
        #: how often serving runs Python in this process (benchmarks/scrape_load.py)
        self.lines_received: Dict[str, int] = {}
        self.frames_sent = 0
        self.wakeups = 0

    # ------------------------------------------------------------------ start
    @property
    def server_address(self) -> Tuple[str, int]:
        """``(host, port)`` the child bound."""
        assert self._bound is not None
        return self._bound

    @property
    def pid(self) -> Optional[int]:
        """The server child's process id (``None`` before start)."""
        return self.proc.pid if self.proc is not None else None

    def start(self) -> "ProcessServer":
        """Render once (what the child serves if this process never answers), spawn the child, send its
        settings and wait for its port.

        Raises :class:`ChildUnavailable` or ``OSError`` (see the class docstring)."""
        self._dir = tempfile.mkdtemp(prefix="mfuwatch-exporter-")
        self._settings["dir"] = self._dir
        try:
            self._write_body(self._render_now(initial=True))
            self._unsent = False  # the child reads this one at start, as not fresh (PushedExposition.push)
            self._bound = (self.host, self._spawn(self.port, self.tries))
        except BaseException:
            self._reap(0.5)
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="mfuwatch-exporter-publisher", daemon=True)
        self._thread.start()
        return self

    def _spawn(self, port: int, tries: int) -> int:
        """Start a server child on ``port`` (``tries`` ports from it) and return the port it bound."""
        env = dict(os.environ, MFUWATCH_DISABLE="1", PYTHONUNBUFFERED="1")
        try:
            self.proc = subprocess.Popen([self.python, "-m", "mfuwatch.agent.live.server_process"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True,
                                         cwd=self._dir)
        except (OSError, ValueError) as exc:
            raise ChildUnavailable(f"cannot start the exporter's server process ({type(exc).__name__}: {exc})") \
                from None
        payload = json.dumps(dict(self._settings, port=int(port), tries=int(tries))).encode()
        try:
            os.write(self.proc.stdin.fileno(), _FRAME.pack(b"C", len(payload)) + payload)
        except OSError as exc:
            raise ChildUnavailable(f"the exporter's server process exited at start ({exc})") from None
        line = self._read_first_line()
        if line.startswith("port "):
            bound = int(line.split()[1])
        elif line.startswith("error "):
            _, e, msg = (line.split(" ", 2) + [""])[:3]
            self._reap(0.5)
            raise OSError(int(e) if e.isdigit() else 0, f"exporter server process: {msg}")
        else:
            raise ChildUnavailable(f"the exporter's server process did not start (answered {line[:200]!r}; "
                                   f"exit status {self.proc.poll()})")
        os.set_blocking(self.proc.stdin.fileno(), False)
        os.set_blocking(self.proc.stdout.fileno(), False)
        return bound

    def _read_first_line(self) -> str:
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + self.start_timeout_s
        data = b""
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildUnavailable(f"the exporter's server process did not answer within "
                                       f"{self.start_timeout_s:g} s")
            if _readable([fd], left):
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                data += chunk
        line, _, rest = data.partition(b"\n")
        self._out_buf = rest
        return line.decode("utf-8", "replace")

    def _reap(self, timeout: float) -> None:
        p = self.proc
        if p is None:
            return
        for f in (p.stdin,):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        try:
            p.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            try:
                p.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        try:
            if p.stdout is not None:
                p.stdout.close()
        except OSError:
            pass

    # ------------------------------------------------------------------ publishing (any thread asks)
    def _poke(self) -> None:
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass

    def refresh(self) -> None:
        """Render and publish soon (an event: a notification outcome, a signal), on the publisher thread."""
        with self._lock:
            self._force = True
        self._poke()

    def refresh_if_read(self) -> None:
        """After a report: render if a scrape read the last bytes and they are half an interval old.

        Checked here first (plain reads of the publisher's state, so at worst one report late), so that a
        report whose render would not be due wakes nothing: in a job nobody scrapes, the publisher thread
        sleeps through every report."""
        if not self._render_due(time.monotonic()):
            return
        with self._lock:
            self._if_read = True
        self._poke()

    def _render_due(self, now: float) -> bool:
        """Whether a report's render is due: a scrape read the current bytes and they are at least half a
        render interval old (or were never rendered)."""
        at = self._rendered_at
        return self._read_version == self.version and (at is None or now - at >= self.min_interval_s / 2)

    def stats(self) -> Dict[str, Any]:
        """The child's last self-monitoring counters (see :meth:`.http_server.MetricsServer.stats`; its
        ``cpu_seconds`` is the whole child's CPU time)."""
        with self._lock:
            return dict(self._stats)

    @property
    def cpu_seconds(self) -> float:
        """CPU seconds of the server child, from its last stats line (at most a second old)."""
        return float(self.stats().get("cpu_seconds", 0.0))

    def _render_now(self, initial: bool = False) -> Optional[bytes]:
        t0 = time.thread_time()
        try:
            body = self._render()
        except Exception as exc:  # noqa: BLE001 - a failing render keeps serving the previous bytes
            from .http_server import report_error

            report_error(self.on_error, "exporter", exc)
            self._rendered_at = time.monotonic()
            return b"" if initial else None
        self._rendered_at = time.monotonic()
        self.renders += 1
        self.render_seconds += time.thread_time() - t0
        return body

    def _write_body(self, body: Optional[bytes]) -> bool:
        if body is None or self._dir is None:
            return False
        tmp = os.path.join(self._dir, "body.tmp")
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, os.path.join(self._dir, "body"))
        self.version += 1
        self._unsent = True
        return True

    def _send_frame(self) -> None:
        if not self._unsent or self.proc is None:
            return
        try:  # under _pub_lock or on the publisher thread: one frame at a time
            os.write(self.proc.stdin.fileno(), _FRAME.pack(b"B", 8) + struct.pack(">Q", self.version))
            self._unsent = False
            self.frames_sent += 1
        except BlockingIOError:  # the pipe is full (the child is not reading): try again later
            pass
        except (OSError, ValueError):
            self._unsent = False

    def _publish(self) -> None:
        try:
            with self._pub_lock:
                if self._write_body(self._render_now()):
                    self._send_frame()
        except OSError as exc:
            from .http_server import report_error

            report_error(self.on_error, "exporter", exc)

    def _run(self) -> None:
        out_fd = self.proc.stdout.fileno()
        buf = getattr(self, "_out_buf", b"")
        child_open = True
        while not self._stop.is_set():
            try:
                fds = [self._wake_r] + ([out_fd] if child_open else [])
                r = _readable(fds, 0.5 if not self._unsent else 0.05)
                self.wakeups += 1
                if self._wake_r in r:
                    os.read(self._wake_r, 4096)
                if child_open and out_fd in r:
                    chunk = os.read(out_fd, 65536)
                    if not chunk:
                        child_open = False
                        self._child_died()
                        if self._respawn():
                            out_fd, buf, child_open = self.proc.stdout.fileno(), getattr(self, "_out_buf", b""), True
                        continue
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        self._on_line(line.decode("utf-8", "replace"))
                self._act()
                if self._unsent:
                    with self._pub_lock:
                        self._send_frame()
            except Exception as exc:  # noqa: BLE001 - the publisher must survive anything
                from .http_server import report_error

                report_error(self.on_error, "exporter", exc)
                self._stop.wait(0.05)

    def _on_line(self, line: str) -> None:
        kind, _, rest = line.partition(" ")
        self.lines_received[kind] = self.lines_received.get(kind, 0) + 1
        if kind == "want":
            with self._lock:
                self._want = True
        elif kind == "read":
            try:
                self._read_version = int(rest)
            except ValueError:
                pass
        elif kind == "stats":
            try:
                st = json.loads(rest)
                with self._lock:
                    self._stats = st
            except ValueError:
                pass
        elif kind == "affinity":
            from .http_server import report_error

            e, _, msg = rest.partition(" ")
            report_error(self.on_error, "exporter", OSError(int(e) if e.isdigit() else 0,
                                                            f"exporter server process: {msg}"))

    def _act(self) -> None:
        with self._lock:
            force, if_read, want, final = self._force, self._if_read, self._want, self._final_wanted
            self._force = self._if_read = self._want = False
            self._final_wanted = False
        if force or final or want or (if_read and self._render_due(time.monotonic())):
            self._publish()
        if final:
            self._final_done.set()

    def _respawn(self) -> bool:
        """After the child died: start another on the same port (the URL in run_info and the file-SD target),
        at most :data:`MAX_RESTARTS` times, 1, 2, 4 s apart. Returns whether one serves again."""
        while self.restarts < MAX_RESTARTS and not self._stop.is_set():
            if self._stop.wait(float(2 ** self.restarts)):
                return False
            self.restarts += 1
            self._reap(0.5)  # the dead one
            try:
                self._spawn(self._bound[1], 1)
            except (ChildUnavailable, OSError) as exc:
                from .http_server import report_error

                report_error(self.on_error, "exporter", exc)
                continue
            if self._stop.is_set():  # close() ran meanwhile: this one must not outlive it
                self._reap(0.5)
                return False
            log.warning("mfuwatch: the exporter's server process was restarted on port %d", self._bound[1])
            self._died_reported = False
            return True
        return False

    def _child_died(self) -> None:
        if self._died_reported or self._stop.is_set():
            return
        self._died_reported = True
        from .http_server import report_error

        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=0.5)  # its stdout's EOF comes a moment before its exit status
            except subprocess.TimeoutExpired:
                pass
        report_error(self.on_error, "exporter", RuntimeError(
            f"the exporter's server process exited (status {code}); /metrics is not served any more"))

    # ------------------------------------------------------------------ stop
    def close(self, timeout: float = 1.0) -> None:
        """A final render, then stop the child; returns within ``timeout`` seconds (the child is killed past
        it). Idempotent."""
        t0 = time.monotonic()
        t = self._thread
        if t is not None and t.is_alive() and not self._stop.is_set():
            with self._lock:
                self._final_wanted = True
            self._poke()
            self._final_done.wait(max(0.0, timeout * 0.4))
        self._stop.set()
        self._poke()
        if t is not None and t is not threading.current_thread():
            t.join(max(0.0, min(0.1, timeout - (time.monotonic() - t0))))
        self._reap(max(0.0, timeout - (time.monotonic() - t0) - 0.05))
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._wake_r = self._wake_w = -1
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self.proc = None

    def forget_after_fork(self) -> None:
        """In a forked child: close this process's copies of the pipes (the parent's server goes on; the
        server child sees EOF only when the parent's copy closes too). Never signals the server child."""
        self._stop.set()
        self._thread = None
        p, self.proc = self.proc, None
        fds = [self._wake_r, self._wake_w]
        self._wake_r = self._wake_w = -1
        if p is not None:
            for f in (p.stdin, p.stdout):
                try:
                    if f is not None:
                        f.close()  # this process's descriptor only
                except OSError:
                    pass
            p.returncode = 0  # this copy of the Popen must never wait for nor kill the parent's child
        for fd in fds:
            if fd is not None and fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._dir = None


if __name__ == "__main__":
    sys.exit(_child_main())
