"""The exporter's HTTP(S) server against hostile and careless clients (issue #28).

Each test runs a real :class:`MetricsServer` on 127.0.0.1 and real sockets; expected bodies come
from prometheus-client itself (``generate_latest`` of the registry, and of its
``restricted_registry`` for ``name[]``).
"""

from __future__ import annotations

import base64
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mfuwatch.agent import Agent
from mfuwatch.agent.config import ConfigError
from mfuwatch.agent.live.http_server import Auth, ExpositionCache, MetricsServer, filter_exposition


def _registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    c = Counter("mfuwatch_steps", "steps", ["run"], registry=reg)
    c.labels("r").inc(7)
    Gauge("mfuwatch_mfu_ratio", "mfu", ["run"], registry=reg).labels("r").set(0.41)
    h = Histogram("mfuwatch_step_duration_seconds", "step time", ["run"], buckets=(0.01, 0.1), registry=reg)
    h.labels("r").observe(0.05)
    return reg


@pytest.fixture
def served():
    reg = _registry()
    servers = []

    def start(**kw):
        cache = ExpositionCache(lambda: generate_latest(reg), kw.pop("min_interval_s", 0.0))
        srv = MetricsServer(cache, "127.0.0.1", 0, **kw).start()
        servers.append(srv)
        return srv, f"http://127.0.0.1:{srv.server_address[1]}"

    yield reg, start
    for s in servers:
        s.close(1.0)


def _families(body: bytes) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: (f.type, f.documentation, sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                                                     for s in f.samples))
            for f in text_string_to_metric_families(body.decode())}


def _get(url: str, headers=None, timeout=5.0, context=None):
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
        return resp.status, resp.read()


def _status(url: str, **kw) -> int:
    try:
        return _get(url, **kw)[0]
    except urllib.error.HTTPError as exc:
        return exc.code


def test_serves_the_registry_exposition_and_only_metrics(served):
    reg, start = served
    _, base = start()
    status, body = _get(base + "/metrics")
    assert status == 200 and body == generate_latest(reg)
    assert _status(base + "/") == 404 and _status(base + "/metrics/x") == 404 and _status(base + "/favicon.ico") == 404
    req = urllib.request.Request(base + "/metrics", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=5)
    assert info.value.code == 405


def test_name_filter_has_prometheus_client_semantics(served):
    reg, start = served
    _, base = start()
    for names in (["mfuwatch_steps_total"], ["mfuwatch_mfu_ratio", "mfuwatch_step_duration_seconds_bucket"],
                  ["mfuwatch_step_duration_seconds_count"], ["nope"]):
        q = "&".join(f"name[]={n}" for n in names)
        status, body = _get(f"{base}/metrics?{q}")
        assert status == 200
        # the same families and samples (prometheus-client orders the families by iterating a set)
        assert _families(body) == _families(generate_latest(reg.restricted_registry(names))), names
    assert filter_exposition(generate_latest(reg), ["nope"]) == b""


def test_a_silent_connection_blocks_neither_scrapes_nor_close(served):
    reg, start = served
    srv, base = start(read_timeout_s=30.0)
    silent = socket.create_connection(srv.server_address)  # connects and never sends a byte
    partial = socket.create_connection(srv.server_address)
    partial.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # a request that never ends
    try:
        for _ in range(5):
            assert _get(base + "/metrics", timeout=2)[1] == generate_latest(reg)
        t0 = time.monotonic()
        srv.close(1.0)
        assert time.monotonic() - t0 < 1.0
        assert not srv._thread.is_alive()
        silent.settimeout(2)
        assert silent.recv(10) == b""  # the server closed its end
    finally:
        silent.close()
        partial.close()


def test_a_client_that_never_reads_does_not_hold_close(served):
    reg, start = served
    g = Gauge("big", "a large exposition", ["i"], registry=reg)
    for i in range(5000):
        g.labels(str(i)).set(i)
    srv, _ = start()
    s = socket.create_connection(srv.server_address)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    for _ in range(20):
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # pipelined, never read
    time.sleep(0.3)
    t0 = time.monotonic()
    srv.close(0.5)  # returns within its bound even if the loop is inside a render of this large exposition
    assert time.monotonic() - t0 < 1.0
    srv._thread.join(5.0)
    assert not srv._thread.is_alive() and srv.open_connections == 0
    s.close()


def test_read_timeout_drops_a_slow_request(served):
    _, start = served
    srv, base = start(read_timeout_s=0.3)
    slow = socket.create_connection(srv.server_address)
    slow.sendall(b"GET /metr")
    slow.settimeout(3)
    t0 = time.monotonic()
    assert slow.recv(10) == b""
    assert 0.25 < time.monotonic() - t0 < 2.0
    assert srv.dropped.get("timeout_read") == 1
    slow.close()


def test_thousand_half_open_connections_keep_threads_bounded_and_scrapes_answering(served):
    reg, start = served
    before = threading.active_count()
    srv, base = start(max_connections=256, read_timeout_s=60.0)
    held = []
    try:
        for i in range(1000):
            s = socket.create_connection(srv.server_address)
            if i % 2:
                s.sendall(b"GET /metrics HTTP/1.1\r\n")  # half a request
            held.append(s)
        time.sleep(0.2)
        assert threading.active_count() == before + 1  # the one loop thread, whatever the clients
        for _ in range(5):
            assert _get(base + "/metrics", timeout=5)[1] == generate_latest(reg)
        assert srv.open_connections <= 256
        assert srv.dropped.get("over_cap", 0) >= 1000 - 256
    finally:
        for s in held:
            s.close()


def test_auth_bearer_and_basic(served):
    _, start = served
    _, base = start(auth=Auth.bearer("s3cret-token"))
    assert _status(base + "/metrics") == 401
    assert _status(base + "/metrics", headers={"Authorization": "Bearer wrong"}) == 401
    assert _status(base + "/metrics", headers={"Authorization": "Bearer s3cret-token"}) == 200
    assert _status(base + "/elsewhere", headers={"Authorization": "Bearer s3cret-token"}) == 404
    _, base = start(auth=Auth.basic("prom", "pa:ss"))
    good = base64.b64encode(b"prom:pa:ss").decode()
    bad = base64.b64encode(b"prom:nope").decode()
    assert _status(base + "/metrics", headers={"Authorization": f"Basic {bad}"}) == 401
    assert _status(base + "/metrics", headers={"Authorization": f"Basic {good}"}) == 200
    assert "pa:ss" not in repr(Auth.basic("prom", "pa:ss"))


def _client_ctx(cert):
    ctx = ssl.create_default_context(cafile=cert[0])
    return ctx


def test_tls_silent_client_times_out_its_handshake_and_blocks_nobody(served, cert):
    reg, start = served
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(*cert)
    srv, _ = start(ssl_context=sctx, handshake_timeout_s=0.4)
    port = srv.server_address[1]
    silent = socket.create_connection(srv.server_address)  # TCP only, no ClientHello
    try:
        for _ in range(3):
            status, body = _get(f"https://127.0.0.1:{port}/metrics", context=_client_ctx(cert), timeout=3)
            assert status == 200 and body == generate_latest(reg)
        silent.settimeout(3)
        t0 = time.monotonic()
        assert silent.recv(10) == b""  # dropped by the handshake timeout
        assert time.monotonic() - t0 < 2.0
        assert srv.dropped.get("timeout_handshake") == 1
        t0 = time.monotonic()
        srv.close(1.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        silent.close()


def test_render_interval_bounds_renders(served):
    calls = []
    cache = ExpositionCache(lambda: calls.append(1) or b"x 1\n", min_interval_s=10.0)
    srv = MetricsServer(cache, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/metrics"
        for _ in range(20):
            assert _get(url)[1] == b"x 1\n"
        assert len(calls) == 1  # twenty scrapes, one render
        cache.refresh()
        assert len(calls) == 2
    finally:
        srv.close()


def test_agent_exporter_auth_from_a_file(tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("tok-123\n")
    base = dict(nvml=False, profile_every="off", alerts=False, flops_per_step=1e9, run="auth", port=0)
    a = Agent(config=dict(base, exporter_auth={"type": "bearer", "token_file": str(token)}))
    try:
        assert _status(a.exporter_url) == 401
        assert _status(a.exporter_url, headers={"Authorization": "Bearer tok-123"}) == 200
        assert "tok-123" not in repr(a.config.to_dict())
    finally:
        a.close()
    monkeypatch.delenv("MFUWATCH_TEST_PW", raising=False)
    with pytest.raises(ConfigError, match="exporter_auth.password: environment variable MFUWATCH_TEST_PW"):
        Agent(config=dict(base, exporter_auth={"type": "basic", "username": "u", "password_env": "MFUWATCH_TEST_PW"}))
    with pytest.raises(ConfigError, match="did you mean 'token_file'"):
        Agent(config=dict(base, exporter_auth={"type": "bearer", "token_fil": "x"}))


def test_the_agent_thread_renders_only_while_someone_scrapes():
    now = [0.0]
    calls = []
    cache = ExpositionCache(lambda: calls.append(1) or b"x 1\n", min_interval_s=1.0, clock=lambda: now[0])
    assert cache.refresh_if_read() is False and calls == []  # nobody scrapes: a report renders nothing
    assert cache.get() == b"x 1\n" and len(calls) == 1  # the first scrape renders
    now[0] = 0.2
    assert cache.refresh_if_read() is False  # read, but rendered 0.2 s ago (< half the interval)
    now[0] = 0.6
    assert cache.refresh_if_read() is True and len(calls) == 2
    assert cache.refresh_if_read() is False  # not read since
    now[0] = 1.0
    cache.get()
    assert len(calls) == 2  # 0.4 s old: served from the cache
