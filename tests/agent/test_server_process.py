"""The exporter's server child process (``exporter_server: process``, issue #28).

Each test runs a real server child (``python -m mfuwatch.agent.live.server_process``) and real sockets;
expected bodies come from prometheus-client itself (``generate_latest`` of the registry, and of its
``restricted_registry`` for ``name[]``).
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mfuwatch.agent import Agent
from mfuwatch.agent.config import ConfigError
from mfuwatch.agent.live import server_process
from mfuwatch.agent.live.http_server import Auth
from mfuwatch.agent.live.server_process import ChildUnavailable, ProcessServer, PushedExposition


def _registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Counter("mfuwatch_steps", "steps", ["run"], registry=reg).labels("r").inc(7)
    Gauge("mfuwatch_mfu_ratio", "mfu", ["run"], registry=reg).labels("r").set(0.41)
    h = Histogram("mfuwatch_step_duration_seconds", "step time", ["run"], buckets=(0.01, 0.1), registry=reg)
    h.labels("r").observe(0.05)
    return reg


def _families(body: bytes) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: (f.type, sorted((s.name, tuple(sorted(s.labels.items())), s.value) for s in f.samples))
            for f in text_string_to_metric_families(body.decode())}


def _get(url, headers=None, timeout=5.0, context=None, method="GET"):
    req = urllib.request.Request(url, headers=headers or {}, method=method,
                                 data=b"x" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int([ln for ln in f if ln.startswith("Threads:")][0].split()[1])


def _wait(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


@pytest.fixture
def served():
    reg = _registry()
    servers = []

    def start(**kw):
        kw.setdefault("min_interval_s", 0.0)
        srv = ProcessServer(lambda: generate_latest(reg), "127.0.0.1", kw.pop("port", 0), **kw).start()
        servers.append(srv)
        return srv, f"http://127.0.0.1:{srv.server_address[1]}"

    yield reg, start
    for s in servers:
        s.close(1.0)


def test_the_child_serves_the_exposition_only_at_metrics_on_port_zero(served):
    reg, start = served
    srv, base = start()
    assert srv.server_address[1] > 0 and srv.pid != os.getpid() and _alive(srv.pid)
    status, body = _get(base + "/metrics")
    assert status == 200 and body == generate_latest(reg)
    assert _get(base + "/")[0] == 404 and _get(base + "/metrics/x")[0] == 404
    assert _get(base + "/metrics", method="POST")[0] == 405
    # a new value reaches the next scrape (min_interval_s 0: every scrape asks the parent for fresh bytes)
    reg._names_to_collectors["mfuwatch_mfu_ratio"].labels("r").set(0.5)
    assert _get(base + "/metrics")[1] == generate_latest(reg)
    # the child runs two threads (its main thread and the event loop), whatever the clients do
    assert _threads(srv.pid) == 2


def test_name_filter_works_on_the_bytes_in_the_child(served):
    reg, start = served
    _, base = start()
    for names in (["mfuwatch_steps_total"], ["mfuwatch_mfu_ratio", "mfuwatch_step_duration_seconds_bucket"],
                  ["nope"]):
        q = "&".join(f"name[]={n}" for n in names)
        status, body = _get(f"{base}/metrics?{q}")
        assert status == 200
        assert _families(body) == _families(generate_latest(reg.restricted_registry(names))), names


def test_tls_and_bearer_auth_in_the_child(served, cert):
    reg, start = served
    srv, _ = start(certfile=cert[0], keyfile=cert[1], auth=Auth.bearer("s3cret"), handshake_timeout_s=0.4)
    url = f"https://127.0.0.1:{srv.server_address[1]}/metrics"
    ctx = ssl.create_default_context(cafile=cert[0])
    silent = socket.create_connection(srv.server_address)  # TCP only, no ClientHello: blocks nobody
    try:
        assert _get(url, context=ctx)[0] == 401
        assert _get(url, context=ctx, headers={"Authorization": "Bearer wrong"})[0] == 401
        status, body = _get(url, context=ctx, headers={"Authorization": "Bearer s3cret"})
        assert status == 200 and body == generate_latest(reg)
        silent.settimeout(3)
        assert silent.recv(10) == b""  # dropped by the handshake timeout
    finally:
        silent.close()
    # the secret went over the pipe, not the command line nor the environment
    with open(f"/proc/{srv.pid}/cmdline", "rb") as f:
        assert b"s3cret" not in f.read()
    with open(f"/proc/{srv.pid}/environ", "rb") as f:
        assert b"s3cret" not in f.read()


def test_basic_auth_in_the_child(served):
    import base64

    _, start = served
    _, base = start(auth=Auth.basic("prom", "pa:ss"))
    good = base64.b64encode(b"prom:pa:ss").decode()
    assert _get(base + "/metrics")[0] == 401
    assert _get(base + "/metrics", headers={"Authorization": f"Basic {good}"})[0] == 200


def test_connection_cap_and_the_counts_come_back_to_the_parent(served):
    reg, start = served
    srv, base = start(max_connections=8, read_timeout_s=60.0)
    held = [socket.create_connection(srv.server_address) for _ in range(50)]
    try:
        time.sleep(0.3)
        assert _get(base + "/metrics")[1] == generate_latest(reg)
        assert _get(base + "/nope")[0] == 404
        assert _threads(srv.pid) == 2
        # 51 connections for 8 places: at least 43 dropped over the cap; the child reports its counts
        assert _wait(lambda: srv.stats()["dropped"].get("over_cap", 0) >= 43 and
                     srv.stats()["answered"].get("404") == 1)
        assert srv.stats()["answered"]["200"] == 1
    finally:
        for s in held:
            s.close()


def test_a_busy_port_moves_to_the_next_one(served):
    _, start = served
    first, _ = start()
    port = first.server_address[1]
    second, base = start(port=port, tries=20)
    assert second.server_address[1] != port and _get(base + "/metrics")[0] == 200
    with pytest.raises(OSError):
        start(port=port, tries=1)


def test_close_returns_within_its_bound_with_a_silent_client_and_the_child_ends(served):
    _, start = served
    srv, base = start(read_timeout_s=30.0)
    pid = srv.pid
    silent = socket.create_connection(srv.server_address)
    partial = socket.create_connection(srv.server_address)
    partial.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
    try:
        assert _get(base + "/metrics")[0] == 200
        renders = srv.renders
        t0 = time.monotonic()
        srv.close(1.0)
        assert time.monotonic() - t0 < 1.5
        assert srv.renders == renders + 1  # the final render before the server stops
        assert not _alive(pid)
        silent.settimeout(2)
        assert silent.recv(10) == b""
    finally:
        silent.close()
        partial.close()


def test_the_child_exits_when_its_parent_is_killed(tmp_path):
    parent = textwrap.dedent("""
        import sys, time
        from mfuwatch.agent.live.server_process import ProcessServer
        s = ProcessServer(lambda: b"x 1\\n", "127.0.0.1", 0).start()
        print(s.pid, s.server_address[1], flush=True)
        time.sleep(120)
    """)
    p = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        pid, port = map(int, p.stdout.readline().split())
        assert _alive(pid) and _get(f"http://127.0.0.1:{port}/metrics")[1] == b"x 1\n"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(5)
        assert _wait(lambda: not _alive(pid), timeout=5.0), "the server child outlived its SIGKILLed parent"
    finally:
        if p.poll() is None:
            p.kill()


def test_the_child_ignores_a_group_sigterm_until_its_parent_closes(served):
    _, start = served
    srv, base = start()
    os.kill(srv.pid, signal.SIGTERM)  # what a scheduler's signal to the process group does to it
    time.sleep(0.2)
    assert _alive(srv.pid) and _get(base + "/metrics")[0] == 200


def test_a_child_that_cannot_start_raises_child_unavailable():
    with pytest.raises(ChildUnavailable):
        ProcessServer(lambda: b"", "127.0.0.1", 0, python="/nonexistent/python").start()
    with pytest.raises(ChildUnavailable):  # starts, but exits before answering
        ProcessServer(lambda: b"", "127.0.0.1", 0, python="/bin/false").start()


_BASE = dict(nvml=False, profile_every="off", alerts=False, flops_per_step=1e9, run="proc", port=0, progress=False)


def test_the_agent_falls_back_to_the_thread_server_counted_once(monkeypatch):
    monkeypatch.setattr(server_process.sys, "executable", "/bin/false")  # a child that exits at once
    a = Agent(config=_BASE)
    try:
        assert a.exporter.mode == "thread" and a.exporter.fallbacks == 1
        status, body = _get(a.exporter_url)
        assert status == 200
        assert 'mfuwatch_agent_errors_total{component="exporter_process",job="proc",rank="0",run="proc"} 1.0' in \
            body.decode()
    finally:
        a.close()


def test_the_agent_serves_from_a_child_by_default_and_the_setting_is_checked():
    a = Agent(config=_BASE)
    try:
        assert a.config.exporter_server == "process" and a.exporter.mode == "process"
        pid = a.exporter._server.pid
        assert pid != os.getpid() and _alive(pid)
        assert _get(a.exporter_url)[0] == 200
    finally:
        a.close()
    assert not _alive(pid)
    t = Agent(config=dict(_BASE, exporter_server="thread"))
    try:
        assert t.exporter.mode == "thread" and _get(t.exporter_url)[0] == 200
    finally:
        t.close()
    with pytest.raises(ConfigError, match=r"exporter_server: expected one of process, thread, got 'fork'"):
        Agent(config=dict(_BASE, exporter_server="fork"))


def test_pushed_exposition_asks_once_parks_and_asks_again_when_unanswered():
    now = [0.0]
    asks, reads = [], []
    src = PushedExposition(1.0, on_ask=lambda: asks.append(now[0]), on_read=reads.append, max_wait_s=0.5,
                           clock=lambda: now[0])
    src.push(b"a 1\n", 1)
    assert src.wants_fresh() == 0.0 and asks == []  # fresh: serve at once
    assert src.get() == b"a 1\n" and reads == [1]
    src.get()
    assert reads == [1]  # one read report per version
    now[0] = 1.0
    assert src.wants_fresh() == 0.5 and asks == [1.0]  # stale: ask the parent, park up to 0.5 s
    now[0] = 1.2
    assert src.wants_fresh() == pytest.approx(0.3) and asks == [1.0]  # asked already
    now[0] = 1.6
    assert src.wants_fresh() == 0.0  # no answer within the wait: serve what there is
    now[0] = 2.6
    assert src.wants_fresh() == 0.5 and asks == [1.0, 2.6]  # still unanswered an interval later: ask again
    src.push(b"a 2\n", 2)
    assert src.wants_fresh(ask=False) == 0.0 and src.get() == b"a 2\n" and reads == [1, 2]


def _sample(body: bytes, name: str, **labels):
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_notification_outcome_reaches_the_next_scrape_at_once(mode):
    """The exposition is re-rendered after a notification outcome: with a 60 s render interval, a scrape after
    the delivery counts it (before, it served the bytes rendered before the send until the interval passed)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from helpers.receiver import AlertReceiver

    with AlertReceiver() as rx:
        os.environ["MFUWATCH_TEST_REFRESH_HOOK"] = rx.url
        alerts = {"use_default_rules": False, "inhibit_rules": [], "evaluation_interval": "1s",
                  "rules": {"MfuLow": {"expr": "mfu", "op": "<", "threshold": 0.25, "for": "0s",
                                       "severity": "critical", "annotations": {"summary": "MFU is {value:pct}"}}},
                  "notifiers": [{"type": "webhook", "url_env": "MFUWATCH_TEST_REFRESH_HOOK", "max_retries": 0}]}
        a = Agent(config=dict(_BASE, alerts=alerts, flops_per_step=1e3, peak_flops=1e15, report_every_steps=5,
                              exporter_render_interval_seconds=60.0, exporter_server=mode))
        try:
            assert a.exporter.mode == mode
            first = _get(a.exporter_url)[1]  # the bytes a scrape holds before anything was sent
            assert _sample(first, "mfuwatch_notifications_total", outcome="sent") == 0.0
            end = time.monotonic() + 20
            while time.monotonic() < end and not rx.wait_for_delivered(1, timeout=0.01):
                a.step(tokens=16)
                time.sleep(0.01)
            assert rx.wait_for_delivered(1, timeout=5)
            assert _wait(lambda: _sample(_get(a.exporter_url)[1], "mfuwatch_notifications_total",
                                         outcome="sent") == 1.0, timeout=5.0)
        finally:
            a.close()
            os.environ.pop("MFUWATCH_TEST_REFRESH_HOOK", None)


def test_a_forked_child_of_the_agent_does_not_keep_the_server_alive_past_the_parent():
    """The server child sees EOF when the agent's process dies even while a child forked from it (a DataLoader
    worker, say) lives on: the fork closes its copy of the pipe (forksafe)."""
    parent = textwrap.dedent("""
        import os, sys, time
        from mfuwatch.agent import Agent
        a = Agent(config=dict(nvml=False, profile_every="off", alerts=False, flops_per_step=1e9, run="fk", port=0,
                              progress=False))
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        print(a.exporter._server.pid, pid, flush=True)
        time.sleep(120)
    """)
    p = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    forked = None
    try:
        server, forked = map(int, p.stdout.readline().split())
        assert _alive(server) and _alive(forked)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(5)
        assert _wait(lambda: not _alive(server), timeout=5.0), "a forked child kept the server child alive"
        assert _alive(forked)  # it was still running: it is not what ended the server
    finally:
        if p.poll() is None:
            p.kill()
        if forked is not None:
            try:
                os.kill(forked, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_server_child_that_dies_is_counted_and_replaced_on_the_same_port():
    reg = _registry()
    errors = []
    srv = ProcessServer(lambda: generate_latest(reg), "127.0.0.1", 0, min_interval_s=0.0,
                        on_error=lambda comp, exc: errors.append((comp, str(exc)))).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/metrics"
        first = srv.pid
        assert _get(url)[1] == generate_latest(reg)
        os.kill(first, signal.SIGKILL)  # the OOM killer, say
        def answers():
            try:
                return _get(url, timeout=2)[0] == 200
            except OSError:  # refused until the new child has bound the port
                return False

        assert _wait(lambda: srv.restarts == 1 and answers(), timeout=10.0)
        assert srv.pid != first and _alive(srv.pid)
        assert _get(url)[1] == generate_latest(reg)  # the same port, the registry's bytes
        assert [c for c, _ in errors] == ["exporter"] and "exited (status -9)" in errors[0][1]
    finally:
        srv.close(1.0)


def test_descriptors_numbered_past_1024_do_not_matter(served):
    """A training process can hold more than 1,024 descriptors (NCCL, loaders): the server's pipes then have
    numbers past select()'s limit; the publisher polls them."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1200
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        reg, start = served
        srv, base = start()
        assert srv.proc.stdout.fileno() > 1024
        assert _get(base + "/metrics")[1] == generate_latest(reg)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _allowed(pid: int) -> dict:
    """{tid: the task's allowed CPUs as a set} for every thread of ``pid`` (/proc/PID/task/TID/status)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            text = [ln for ln in f if ln.startswith("Cpus_allowed_list:")][0].split(":", 1)[1].strip()
        cpus = set()
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        out[int(tid)] = cpus
    return out


def test_server_cpus_pin_every_thread_of_the_child_and_the_default_inherits(served):
    """``cpus`` applies in the child before its loop thread starts, so both of its threads run there (an
    affinity set from outside on the child's pid moves its main thread only: benchmarks/scrape_load.py run 3)."""
    reg, start = served
    mine = os.sched_getaffinity(0)
    srv, base = start()
    tasks = _allowed(srv.pid)
    assert len(tasks) == 2 and all(c == mine for c in tasks.values())  # inherited
    cpu = max(mine)
    pinned, base2 = start(cpus=[cpu])
    assert _get(base2 + "/metrics") == (200, generate_latest(reg))
    tasks = _allowed(pinned.pid)
    assert len(tasks) == 2 and all(c == {cpu} for c in tasks.values())
    assert os.sched_getaffinity(0) == mine  # the parent is not moved
    # what moving the child from outside does: only the thread whose id is the pid
    os.sched_setaffinity(srv.pid, {cpu})
    tasks = _allowed(srv.pid)
    assert tasks[srv.pid] == {cpu} and [c for t, c in tasks.items() if t != srv.pid] == [mine]


def test_server_cpus_the_kernel_refuses_are_reported_and_the_child_serves_on(served):
    reg, start = served
    errors = []
    bad = (os.cpu_count() or 1) + 64  # no such CPU: sched_setaffinity fails with EINVAL
    srv, base = start(cpus=[bad], on_error=lambda comp, exc: errors.append((comp, exc)))
    assert _get(base + "/metrics") == (200, generate_latest(reg))
    assert _wait(lambda: errors, timeout=5.0)
    (comp, exc), = errors
    assert comp == "exporter" and isinstance(exc, OSError) and exc.errno == 22 and f"cpus [{bad}]" in str(exc)
    assert srv.lines_received.get("affinity") == 1
    assert all(c == os.sched_getaffinity(0) for c in _allowed(srv.pid).values())  # the inherited affinity


def test_the_publisher_counts_what_crosses_the_pipes_and_sleeps_through_reports_nobody_read(served):
    """One scrape of the start-up bytes (not fresh): the child asks once (``want``), the parent renders and
    sends one frame, the scrape is served that version and the child reports it read (``read 2``). A report
    (``refresh_if_read``) wakes the publisher only when a scrape read the current bytes and they are half an
    interval old."""
    reg, start = served
    srv, base = start(min_interval_s=0.4)
    pokes = []
    poke = srv._poke
    srv._poke = lambda: (pokes.append(1), poke())
    assert srv.renders == 1 and srv.frames_sent == 0  # the start-up render, read by the child at start
    for _ in range(20):
        srv.refresh_if_read()  # nothing read yet: no render due, nothing woken
    assert pokes == [] and srv.renders == 1
    assert _get(base + "/metrics") == (200, generate_latest(reg))
    assert _wait(lambda: srv.lines_received.get("read") == 1, timeout=5.0)
    assert srv.lines_received.get("want") == 1 and srv.frames_sent == 1 and srv.renders == 2
    assert srv.version == 2 and srv._read_version == 2  # version 1: the start-up bytes
    at = srv._rendered_at
    assert not srv._render_due(at + 0.19) and srv._render_due(at + 0.21)  # half of 0.4 s (at + 0.2 - at may round below 0.2)
    time.sleep(max(0.0, at + 0.25 - time.monotonic()))
    srv.refresh_if_read()  # read and older than half the interval: one wake-up, one render, one frame
    assert pokes == [1]
    assert _wait(lambda: srv.frames_sent == 2, timeout=5.0)
    assert srv.renders == 3 and srv.version == 3 and srv.wakeups >= 2
    for _ in range(20):
        srv.refresh_if_read()  # version 3 was never scraped: nothing woken
    assert pokes == [1] and srv.renders == 3


def test_exporter_server_cpus_setting_is_parsed_checked_and_reaches_the_child():
    from mfuwatch.agent.live.settings import parse_cpus

    n = os.cpu_count()
    assert parse_cpus(None, ConfigError) is None
    assert parse_cpus(0, ConfigError) == [0]
    assert parse_cpus([0, 0], ConfigError) == [0]
    assert parse_cpus(f"0-{n - 1}", ConfigError) == list(range(n))
    assert parse_cpus(f" {n - 1}, 0 ", ConfigError) == sorted({0, n - 1})
    for bad, match in [("", "empty set"), ([], "empty set"), (True, "expected null"), ("1-0", "ends before"),
                       ("a", "expected null"), ([0.5], "expected null"), (n, f"CPU {n} does not exist"),
                       (f"0-{n}", f"CPU {n} does not exist"), (-1, "CPU -1 does not exist")]:
        with pytest.raises(ConfigError, match=r"exporter_server_cpus: .*" + match):
            parse_cpus(bad, ConfigError)
    with pytest.raises(ConfigError, match=r"exporter_server_cpus: CPU"):
        Agent(config=dict(_BASE, exporter_server_cpus=[n + 3]))
    with pytest.raises(ConfigError, match=r"exporter_server_cpus: applies to the server child only"):
        Agent(config=dict(_BASE, exporter_server="thread", exporter_server_cpus=[0]))
    cpu = max(os.sched_getaffinity(0))
    a = Agent(config=dict(_BASE, exporter_server_cpus=str(cpu)))
    try:
        assert a.config.exporter_server_cpus == [cpu] and a.exporter.mode == "process"
        assert _get(a.exporter_url)[0] == 200
        tasks = _allowed(a.exporter._server.pid)
        assert len(tasks) == 2 and all(c == {cpu} for c in tasks.values())
    finally:
        a.close()
