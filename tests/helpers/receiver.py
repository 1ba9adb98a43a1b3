"""A real HTTP receiver on 127.0.0.1 for notifier tests (Slack / webhook stand-in).

Records every request (path, headers, body) and answers from a script of
responses, so a test can play a receiver that is down, slow, rate-limiting or
failing and then recovers::

    with AlertReceiver() as rx:
        rx.script(Reply(500), Reply(429, headers={"Retry-After": "1"}))   # then 200 "ok"
        ... point a notifier at rx.url ...
        assert rx.wait_for_delivered(1, timeout=10)
        body = rx.delivered[0].json

"Down" is a port nobody listens on: ``port = free_port()`` (:mod:`tests.helpers.net`) and start an
``AlertReceiver(port=port)`` later to recover.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional


@dataclass
class Reply:
    """One scripted answer: status, headers, body, and seconds to wait before answering."""

    status: int = 200
    headers: Dict[str, str] = field(default_factory=dict)
    body: str = "ok"
    delay: float = 0.0


@dataclass
class Received:
    """One request as the receiver saw it, and the status it answered."""

    path: str
    headers: Dict[str, str]
    body: bytes
    status: int
    at: float  # time.monotonic() on arrival

    @property
    def json(self) -> Any:
        return json.loads(self.body.decode("utf-8"))


class AlertReceiver:
    """HTTP server on 127.0.0.1 (``port=0``: any free port) recording POSTs; thread-safe."""

    def __init__(self, port: int = 0, path: str = "/hook") -> None:
        self._port = port
        self.path = path
        self._lock = threading.Condition()
        self._script: List[Reply] = []
        self.default = Reply()
        self.received: List[Received] = []  # appended when the answer is about to be sent
        self.arrivals = 0  # requests that reached the handler (before any scripted delay)
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    # -- control ---------------------------------------------------------------------------
    def start(self) -> "AlertReceiver":
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                with rx._lock:
                    rx.arrivals += 1
                    rx._lock.notify_all()
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                reply = rx._next_reply()
                rec = Received(self.path, dict(self.headers.items()), body, reply.status, time.monotonic())
                if reply.delay:
                    time.sleep(reply.delay)
                with rx._lock:
                    rx.received.append(rec)
                    rx._lock.notify_all()
                try:
                    data = reply.body.encode("utf-8")
                    self.send_response(reply.status)
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout) before the answer
                    pass

            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        self._server.daemon_threads = True
        self._port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="test-alert-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "AlertReceiver":
        return self.start() if self._server is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}{self.path}"

    def script(self, *replies: Reply) -> None:
        """Answer the next requests with ``replies`` in order, then with :attr:`default`."""
        with self._lock:
            self._script.extend(replies)

    def _next_reply(self) -> Reply:
        with self._lock:
            return self._script.pop(0) if self._script else self.default

    # -- reading -------------------------------------------------------------------------
    @property
    def delivered(self) -> List[Received]:
        """Requests answered with 2xx, in arrival order."""
        with self._lock:
            return [r for r in self.received if 200 <= r.status < 300]

    def wait_for(self, n: int, timeout: float = 10.0) -> bool:
        """Wait until at least ``n`` requests arrived (any status)."""
        return self._wait(lambda: len(self.received) >= n, timeout)

    def wait_for_arrivals(self, n: int, timeout: float = 10.0) -> bool:
        """Wait until at least ``n`` requests reached the handler (answered or not yet)."""
        return self._wait(lambda: self.arrivals >= n, timeout)

    def wait_for_delivered(self, n: int, timeout: float = 10.0) -> bool:
        """Wait until at least ``n`` requests were answered with 2xx."""
        return self._wait(lambda: sum(1 for r in self.received if 200 <= r.status < 300) >= n, timeout)

    def _wait(self, predicate, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with self._lock:
            while not predicate():
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True
