"""The exporter's HTTP(S) server: one event-loop thread that no client can stall, serving pre-rendered bytes.

Why not ``prometheus_client.start_http_server``: it runs the TLS handshake on its single accept
thread with no timeout (one silent TCP connection stops every scrape and ``close()``), starts a
thread per connection with no cap (300 half-open connections hold 300 threads), and renders the
exposition in every request, holding the interpreter lock the training thread needs to launch
kernels (docs/reliability.md has the measurements). Here:

* one thread, one ``selectors`` loop (epoll on Linux) for every connection: accepting, the TLS
  handshake (non-blocking, :attr:`handshake_timeout_s` per connection), reading the request
  (:attr:`read_timeout_s` from its first byte, at most :data:`MAX_REQUEST_BYTES`) and writing the
  answer (the same timeout); the thread count does not depend on the clients;
* at most :attr:`max_connections` open connections: past the cap the oldest connection that has
  not sent a whole request is dropped (a flood of idle sockets cannot lock out a real scraper);
* the exposition is rendered by :class:`ExpositionCache` at most once per
  ``min_interval_s`` (prometheus-client's ``generate_latest`` on the agent's registry), and the
  agent thread may refresh it after each report; a scrape copies bytes. By default this loop runs in a
  server child process (:mod:`.server_process`), whose source of bytes is the renders the training
  process pushes: a request that finds them stale is parked (state ``wait``, off the selector) until
  fresh bytes arrive or its short wait ends (:meth:`MetricsServer.wake`);
* the loop's own CPU time is held under ``max_cpu_share`` of wall time (a token bucket on
  ``time.thread_time()``): when clients ask for more, they wait in the kernel's accept and receive
  queues while the loop sleeps with the interpreter lock released, so the training thread's share
  of the lock does not depend on how many clients there are or how fast they ask;
* ``/metrics`` only (``GET``/``HEAD``; other paths 404, other methods 405); ``name[]`` filters the
  samples as prometheus-client's ``restricted_registry`` does (samples whose name is listed; a
  family's ``# HELP``/``# TYPE`` only with a kept sample);
* optional bearer-token or basic authentication (:class:`Auth`, what Prometheus' scrape config
  sends with ``authorization`` / ``basic_auth``), compared in constant time; 401 otherwise;
* :meth:`MetricsServer.close` returns within its timeout whatever the clients do.
"""

from __future__ import annotations

import base64
import errno
import gzip
import hmac
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("mfuwatch")

#: Largest request (request line and headers) read from a client; a Prometheus scrape sends ~300 bytes.
MAX_REQUEST_BYTES = 16 * 1024
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def report_error(on_error: Optional[Callable[[str, BaseException], None]], component: str,
                 exc: BaseException) -> None:
    """Tell ``on_error`` (the agent's error counter, or ``None``) of ``exc``; a failing callback is ignored."""
    if on_error is not None:
        try:
            on_error(component, exc)
        except Exception:  # noqa: BLE001 - reporting must not raise into the server loop or a render
            pass


@dataclass(frozen=True)
class Auth:
    """What a scrape must send in ``Authorization``: ``Bearer <token>`` or ``Basic base64(user:password)``.

    Build it with :meth:`bearer` or :meth:`basic`; the expected header value is held, never printed.
    """

    scheme: str  # "Bearer" or "Basic"
    _expected: bytes

    @classmethod
    def bearer(cls, token: str) -> "Auth":
        """Prometheus ``authorization: {type: Bearer, credentials: <token>}``."""
        return cls("Bearer", f"Bearer {token}".encode())

    @classmethod
    def basic(cls, username: str, password: str) -> "Auth":
        """Prometheus ``basic_auth: {username, password}`` (RFC 7617)."""
        cred = base64.b64encode(f"{username}:{password}".encode()).decode("ascii")
        return cls("Basic", f"Basic {cred}".encode())

    def allows(self, header: Optional[bytes]) -> bool:
        """Whether the ``Authorization`` header value ``header`` carries the expected credentials."""
        if header is None:
            return False
        scheme, _, rest = header.strip().partition(b" ")
        got = scheme.capitalize() + b" " + rest.strip()
        return hmac.compare_digest(got, self._expected)

    def __repr__(self) -> str:
        return f"Auth({self.scheme}, <redacted>)"


class ExpositionCache:
    """The exposition bytes of the last render and their gzip, re-rendered at most every ``min_interval_s``.

    Args:
        render: returns the text exposition (bytes), e.g. ``lambda: generate_latest(registry)``.
        min_interval_s: a :meth:`get` within this many seconds of the last render returns the cached bytes.
        clock: ``time.monotonic``-like (tests).

    :meth:`refresh` renders now; :meth:`refresh_if_read` only while someone scrapes (the agent thread
    calls it after a report, so scrapes see the new measurement without rendering it themselves). Thread-safe; a ``render`` that raises leaves the previous bytes in place
    and is reported to ``on_error`` (``b""`` before the first success).
    """

    def __init__(self, render: Callable[[], bytes], min_interval_s: float = 0.25,
                 on_error: Optional[Callable[[str, BaseException], None]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._render = render
        self.min_interval_s = float(min_interval_s)
        self.on_error = on_error
        self._clock = clock
        self._lock = threading.Lock()
        self._body = b""
        self._gz: Optional[bytes] = None
        self._at: Optional[float] = None
        self._read = False  # a scrape read the bytes since the last render
        self.renders = 0

    def refresh(self) -> bytes:
        """Render now and return the bytes."""
        with self._lock:
            return self._refresh_locked()

    def refresh_if_read(self) -> bool:
        """Render now if a scrape read the bytes since the last render and they are at least half of
        ``min_interval_s`` old (the agent thread after a report: a new measurement reaches the next scrape
        without the scrape rendering it, and a job nobody scrapes renders nothing). Returns whether it rendered."""
        with self._lock:
            if not self._read or (self._at is not None and self._clock() - self._at < self.min_interval_s / 2):
                return False
            self._refresh_locked()
            return True

    def _refresh_locked(self) -> bytes:
        try:
            body = self._render()
        except Exception as exc:  # noqa: BLE001 - a failing render keeps serving the previous bytes
            report_error(self.on_error, "exporter", exc)
            self._at = self._clock()
            return self._body
        self._body, self._gz, self._at = body, None, self._clock()
        self._read = False
        self.renders += 1
        return body

    def get(self, gzipped: bool = False) -> bytes:
        """The exposition (gzip-compressed with ``gzipped``), rendered first if older than ``min_interval_s``."""
        with self._lock:
            if self._at is None or self._clock() - self._at >= self.min_interval_s:
                self._refresh_locked()
            self._read = True
            if not gzipped:
                return self._body
            if self._gz is None:
                self._gz = gzip.compress(self._body, compresslevel=1)
            return self._gz


def filter_exposition(text: bytes, names: Sequence[str]) -> bytes:
    """The samples of a text exposition whose sample name is in ``names``, with their family's HELP/TYPE.

    The semantics of prometheus-client's ``restricted_registry`` (what its handler does for
    ``?name[]=``): ``mfuwatch_steps_total`` keeps that sample, ``mfuwatch_step_duration_seconds_bucket``
    the histogram's buckets; a family none of whose samples is listed is left out whole.
    """
    wanted = {n.encode() if isinstance(n, str) else n for n in names}
    out: List[bytes] = []
    header: List[bytes] = []
    header_family = None
    for line in text.split(b"\n"):
        if not line:
            continue
        if line.startswith(b"#"):
            parts = line.split(b" ", 3)
            fam = parts[2] if len(parts) > 2 else b""
            if fam != header_family:
                header, header_family = [], fam
            header.append(line)
            continue
        end = len(line)
        for sep in (b"{", b" "):
            i = line.find(sep)
            if 0 <= i < end:
                end = i
        if line[:end] in wanted:
            if header:
                out.extend(header)
                header = []
            out.append(line)
    return b"\n".join(out) + (b"\n" if out else b"")


class _Conn:
    __slots__ = ("sock", "state", "buf", "out", "deadline", "opened", "keep_alive", "served", "events", "pending")

    def __init__(self, sock, state: str, deadline: float, opened: float) -> None:
        self.sock = sock
        self.state = state  # "handshake" | "read" | "write"
        self.buf = b""
        self.out = memoryview(b"")
        self.deadline = deadline
        self.opened = opened
        self.keep_alive = False
        self.served = 0
        self.events = 1  # selectors.EVENT_READ: what the selector waits for on this socket
        self.pending: Optional[tuple] = None  # state "wait": (names, gzipped, head, keep) of the parked answer


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large"}
#: every HTTP status the server answers with (``mfuwatch_exporter_requests_total{code}``)
STATUSES = tuple(sorted(_REASONS))


class MetricsServer:
    """HTTP(S) server of ``/metrics`` from an :class:`ExpositionCache`, on one thread (see the module docstring).

    Args:
        cache: where the bytes come from.
        host, port: where to listen (``port=0``: any free port). Binding happens in :meth:`start`.
        ssl_context: a server-side ``ssl.SSLContext`` for HTTPS, or ``None``.
        auth: an :class:`Auth` every request must satisfy, or ``None``.
        max_connections: open connections at most (past it the oldest one without a whole request is dropped).
        read_timeout_s: seconds a connection may take from its request's first byte to its end, and to
            take the answer; an idle keep-alive connection is closed after as long.
        handshake_timeout_s: seconds a TLS handshake may take.
        max_cpu_share: the loop's CPU time per wall second, at most (0 < share <= 1).
        on_error: told ``("exporter", exc)`` of an unexpected error in the loop (which goes on).

    Raises:
        OSError: from :meth:`start`, when the address cannot be bound.
    """

    def __init__(self, cache: ExpositionCache, host: str, port: int, *, ssl_context: Optional[ssl.SSLContext] = None,
                 auth: Optional[Auth] = None, max_connections: int = 256, read_timeout_s: float = 10.0,
                 handshake_timeout_s: float = 5.0, max_cpu_share: float = 0.03,
                 on_error: Optional[Callable[[str, BaseException], None]] = None) -> None:
        self.cache = cache
        self.host, self.port = host, port
        self.ssl_context = ssl_context
        self.auth = auth
        self.max_connections = int(max_connections)
        self.read_timeout_s = float(read_timeout_s)
        self.handshake_timeout_s = float(handshake_timeout_s)
        self.max_cpu_share = float(max_cpu_share)
        self.on_error = on_error
        self._sel: Optional[selectors.BaseSelector] = None
        self._lsock: Optional[socket.socket] = None
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._conns: Dict[int, _Conn] = {}
        self._waiting: List[_Conn] = []  # requests parked until fresher bytes arrive (a source with wants_fresh)
        self._wants_fresh = getattr(cache, "wants_fresh", None)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        #: counters for tests and diagnostics: requests answered by status, connections dropped by reason
        self.answered: Dict[int, int] = {}
        self.dropped: Dict[str, int] = {}
        self.throttled_seconds = 0.0
        #: CPU seconds the loop thread has used (``time.thread_time``): rendering, TLS, requests
        self.cpu_seconds = 0.0

    # ------------------------------------------------------------------ control (any thread)
    @property
    def server_address(self) -> Tuple[str, int]:
        """``(host, port)`` actually bound."""
        assert self._lsock is not None
        return self._lsock.getsockname()[:2]

    def start(self) -> "MetricsServer":
        """Bind, listen and start the loop thread. Raises ``OSError`` when the address cannot be bound."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        ls = socket.socket(family, socket.SOCK_STREAM)
        try:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((self.host, self.port))
            ls.listen(128)
            ls.setblocking(False)
        except BaseException:
            ls.close()
            raise
        self._lsock = ls
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(ls, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="mfuwatch-exporter", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 1.0) -> None:
        """Stop the loop and close every socket; returns within ``timeout`` seconds. Idempotent."""
        self._stop.set()
        if self._wake_w is not None:
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=max(0.0, timeout))
        if t is None or not t.is_alive():
            self._close_all()

    def forget_after_fork(self) -> None:
        """In a forked child: close this process's copies of the sockets without touching the parent's.

        Nothing is unregistered (the epoll set is shared with the parent) nor shut down; closing a
        descriptor in the child leaves the parent's socket open and serving.
        """
        self._stop.set()
        self._thread = None
        socks = [c.sock for c in self._conns.values()] + [self._lsock, self._wake_r, self._wake_w]
        self._conns = {}
        sel, self._sel = self._sel, None
        self._lsock = self._wake_r = self._wake_w = None
        for s in socks:
            if s is not None:
                try:
                    socket.socket.close(s)
                except OSError:
                    pass
        if sel is not None:
            try:
                sel.close()
            except Exception:  # noqa: BLE001
                pass

    @property
    def open_connections(self) -> int:
        """Connections open now."""
        return len(self._conns)

    def wake(self) -> None:
        """Make the loop look at its source again now (new bytes arrived: answer the parked requests). Any thread."""
        if self._wake_w is not None:
            try:
                self._wake_w.send(b"w")
            except OSError:
                pass

    def stats(self) -> Dict[str, object]:
        """The server's self-monitoring counters (copies): ``answered`` {status: requests}, ``dropped``
        {reason: connections}, ``cpu_seconds`` of the loop thread, ``throttled_seconds`` it slept for the cap."""
        return {"answered": dict(self.answered), "dropped": dict(self.dropped), "cpu_seconds": self.cpu_seconds,
                "throttled_seconds": self.throttled_seconds}

    # ------------------------------------------------------------------ the loop thread
    def _count_drop(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1

    def _run(self) -> None:
        budget = 0.05  # CPU seconds the loop may spend before it must sleep (refills at max_cpu_share)
        last_wall, last_cpu = time.monotonic(), time.thread_time()
        last_sweep = last_wall
        while not self._stop.is_set():
            try:
                timeout = 0.25
                if self._conns:
                    timeout = max(0.0, min(timeout, min(c.deadline for c in self._conns.values()) - time.monotonic())
                                  if len(self._conns) <= 64 else timeout)
                events = self._sel.select(timeout)
                for key, mask in events:
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        try:
                            self._wake_r.recv(64)
                        except OSError:
                            pass
                    else:
                        self._service(key.data, mask)
                now = time.monotonic()
                if self._waiting:
                    self._answer_waiting(now)
                if now - last_sweep >= 0.1 or not events:
                    last_sweep = now
                    for c in [c for c in self._conns.values() if c.deadline <= now and c.state != "wait"]:
                        self._count_drop("timeout_" + c.state)
                        self._drop(c)
                # hold the loop's CPU time under max_cpu_share of wall time
                cpu = time.thread_time()
                self.cpu_seconds += cpu - last_cpu
                budget += (now - last_wall) * self.max_cpu_share - (cpu - last_cpu)
                budget = min(budget, 0.05)
                last_wall, last_cpu = now, cpu
                if budget < 0:
                    pause = min(0.2, -budget / self.max_cpu_share)
                    self.throttled_seconds += pause
                    self._stop.wait(pause)
            except Exception as exc:  # noqa: BLE001 - the loop must survive anything a client does
                report_error(self.on_error, "exporter", exc)
                self._stop.wait(0.01)
        self._close_all()

    def _close_all(self) -> None:
        self._waiting = []
        for c in list(self._conns.values()):
            self._drop(c)
        sel, self._sel = self._sel, None
        for s in (self._lsock, self._wake_r, self._wake_w):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass
        self._lsock = self._wake_r = self._wake_w = None
        if sel is not None:
            try:
                sel.close()
            except Exception:  # noqa: BLE001
                pass

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: wait for a sweep to free descriptors
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._count_drop("accept_" + errno.errorcode.get(exc.errno, "error"))
                    return
                raise
            sock.setblocking(False)
            if len(self._conns) >= self.max_connections:
                self._evict_one()
            now = time.monotonic()
            if self.ssl_context is not None:
                try:
                    sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (OSError, ValueError):
                    sock.close()
                    self._count_drop("tls_wrap")
                    continue
                c = _Conn(sock, "handshake", now + self.handshake_timeout_s, now)
            else:
                c = _Conn(sock, "read", now + self.read_timeout_s, now)
            self._conns[sock.fileno()] = c
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _evict_one(self) -> None:
        """Drop the oldest connection that has no whole request (else the oldest of all)."""
        idle = [c for c in self._conns.values() if c.state not in ("write", "wait")]
        victim = min(idle or self._conns.values(), key=lambda c: c.opened)
        self._count_drop("over_cap")
        self._drop(victim)

    def _drop(self, c: _Conn) -> None:
        fd = None
        try:
            fd = c.sock.fileno()
        except OSError:
            pass
        found = None
        if fd is not None and fd >= 0:
            found = self._conns.pop(fd, None)
        if found is None:  # the socket is already closed: find it by identity
            for k, v in list(self._conns.items()):
                if v is c:
                    del self._conns[k]
        if self._sel is not None:
            try:
                self._sel.unregister(c.sock)
            except (KeyError, ValueError, OSError):
                pass
        try:
            c.sock.close()
        except OSError:
            pass

    def _set_events(self, c: _Conn, events: int) -> None:
        if c.events == events:
            return
        try:
            self._sel.modify(c.sock, events, c)
            c.events = events
        except (KeyError, ValueError, OSError):
            self._drop(c)

    def _service(self, c: _Conn, mask: int) -> None:
        try:
            if c.state == "handshake":
                self._handshake(c)
            elif c.state == "read":
                self._read(c)
            elif c.state == "write":
                self._write(c)
        except (ssl.SSLError, OSError):
            self._count_drop("io_" + c.state)
            self._drop(c)

    def _handshake(self, c: _Conn) -> None:
        try:
            c.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._set_events(c, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._set_events(c, selectors.EVENT_WRITE)
            return
        c.state, c.deadline = "read", time.monotonic() + self.read_timeout_s
        self._set_events(c, selectors.EVENT_READ)
        self._read(c)  # the client may have sent its request with the handshake's last flight

    def _read(self, c: _Conn) -> None:
        while True:
            try:
                data = c.sock.recv(65536)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                return
            except ssl.SSLWantWriteError:
                self._set_events(c, selectors.EVENT_WRITE)
                return
            if not data:
                self._drop(c)
                return
            if not c.buf and c.served:  # a new request on a kept-alive connection: its own deadline
                c.deadline = time.monotonic() + self.read_timeout_s
            c.buf += data
            end = c.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(c.buf) > MAX_REQUEST_BYTES:
                    self._answer(c, 431, b"request too large\n", close=True)
                    return
                continue
            head, c.buf = c.buf[:end], b""
            self._handle(c, head)
            return

    def _handle(self, c: _Conn, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            self._answer(c, 400, b"bad request\n", close=True)
            return
        method, target, version = parts
        headers: Dict[bytes, bytes] = {}
        for line in lines[1:]:
            k, sep, v = line.partition(b":")
            if sep:
                headers[k.strip().lower()] = v.strip()
        conn_hdr = headers.get(b"connection", b"").lower()
        keep = (version == b"HTTP/1.1" and conn_hdr != b"close") or conn_hdr == b"keep-alive"
        if self.auth is not None and not self.auth.allows(headers.get(b"authorization")):
            self._answer(c, 401, b"unauthorized\n", close=not keep,
                         extra=b"WWW-Authenticate: " + self.auth.scheme.encode() + b' realm="mfuwatch"\r\n')
            return
        if target == b"/metrics":  # the common case: no query string to parse
            path, query = "/metrics", ""
        else:
            try:
                url = urlsplit(target.decode("latin-1"))
            except ValueError:
                self._answer(c, 400, b"bad request\n", close=True)
                return
            path, query = url.path, url.query
        if path != "/metrics":
            self._answer(c, 404, b"not found: the mfuwatch exporter serves /metrics only\n", close=not keep)
            return
        if method not in (b"GET", b"HEAD"):
            self._answer(c, 405, b"method not allowed\n", close=not keep, extra=b"Allow: GET, HEAD\r\n")
            return
        names = parse_qs(query).get("name[]") if query else None
        gz = b"gzip" in headers.get(b"accept-encoding", b"") and not names
        wait_s = self._wants_fresh() if self._wants_fresh is not None else 0.0
        if wait_s > 0:  # the source is stale and fresher bytes are on their way: park the answer
            c.pending = (names, gz, method == b"HEAD", keep)
            c.state, c.deadline = "wait", time.monotonic() + wait_s
            try:
                self._sel.unregister(c.sock)  # nothing to read or write until answered (level-triggered epoll)
            except (KeyError, ValueError, OSError):
                pass
            c.events = 0
            self._waiting.append(c)
            return
        self._serve(c, names, gz, method == b"HEAD", keep)

    def _serve(self, c: _Conn, names, gz: bool, head: bool, keep: bool) -> None:
        body = self.cache.get(gzipped=gz)
        if names:
            body = filter_exposition(body, names)
        self._answer(c, 200, body, close=not keep, gzipped=gz, head=head)

    def _answer_waiting(self, now: float) -> None:
        """Answer the parked requests once the source is fresh again or their wait is over."""
        fresh = self._wants_fresh is None or self._wants_fresh(ask=False) <= 0
        still = []
        for c in self._waiting:
            if c.sock.fileno() < 0 or self._conns.get(c.sock.fileno()) is not c:
                continue  # dropped meanwhile (over the cap, closed)
            if not fresh and c.deadline > now:
                still.append(c)
                continue
            try:
                self._sel.register(c.sock, selectors.EVENT_READ, c)
                c.events = selectors.EVENT_READ
                names, gz, head, keep = c.pending
                c.pending = None
                self._serve(c, names, gz, head, keep)
            except (ssl.SSLError, OSError, ValueError, KeyError):
                self._count_drop("io_wait")
                self._drop(c)
        self._waiting = still

    def _answer(self, c: _Conn, status: int, body: bytes, *, close: bool, gzipped: bool = False,
                head: bool = False, extra: bytes = b"") -> None:
        self.answered[status] = self.answered.get(status, 0) + 1
        ctype = CONTENT_TYPE if status == 200 else b"text/plain; charset=utf-8"
        hdr = (b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" %
               (status, _REASONS.get(status, "").encode(), ctype, len(body)))
        if gzipped:
            hdr += b"Content-Encoding: gzip\r\n"
        hdr += extra + (b"Connection: close\r\n\r\n" if close else b"\r\n")
        c.out = memoryview(hdr + (b"" if head else body))
        c.keep_alive = not close
        c.state, c.deadline = "write", time.monotonic() + self.read_timeout_s
        self._write(c)

    def _write(self, c: _Conn) -> None:
        while c.out:
            try:
                n = c.sock.send(c.out)
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
                self._set_events(c, selectors.EVENT_WRITE)
                return
            except ssl.SSLWantReadError:
                self._set_events(c, selectors.EVENT_READ)
                return
            c.out = c.out[n:]
        c.served += 1
        if not c.keep_alive:
            self._drop(c)
            return
        c.state, c.deadline = "read", time.monotonic() + self.read_timeout_s
        self._set_events(c, selectors.EVENT_READ)
