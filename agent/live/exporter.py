"""Prometheus exporter: the agent's measurements as ``mfuwatch_*`` series on its own registry.

Counters and the step-time histogram are prometheus-client objects updated by
the agent's thread. Everything else is computed at scrape time by
:class:`MeasurementCollector` from the latest measurement dataclasses (the
pattern of prometheus-client's own ``gc_collector``): a source with no data
yields no series rather than a stale or made-up value. Every series carries
``run`` and ``rank``; names come from :class:`mfuwatch.agent.schema.M`.
"""

from __future__ import annotations

import errno
import logging
import threading
from typing import Any, Callable, Dict, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from ..schema import M, GpuHealth, RunInfo, StepMeasurement, WindowMeasurement

log = logging.getLogger("mfuwatch")

#: Step-time buckets (seconds): 1 ms .. 60 s, dense around the 10 ms - 2 s range of LLM steps.
STEP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0,
)


class MeasurementCollector(Collector):
    """Scrape-time gauges from the latest step, window and NVML measurements."""

    def __init__(self, run_info: RunInfo) -> None:
        self.run_info = run_info
        self._lock = threading.Lock()
        #: Unix time (seconds) the last optimizer step ended, written by the step hook at each boundary (one
        #: float store, no lock: it is read whole); ``mfuwatch_last_step_timestamp_seconds`` serves it, so the
        #: gauge moves per step and not only when the agent thread reports.
        self.last_step_wall: Optional[float] = None
        self.step: Optional[StepMeasurement] = None
        self.window: Optional[WindowMeasurement] = None
        self.gpu: Optional[GpuHealth] = None
        #: ``() -> seconds or None``: the stall clock (mfuwatch.alerts.stall.StallClock.seconds), read at scrape
        self.stall_seconds: Optional[Callable[[], Optional[float]]] = None

    def update(self, *, step: Optional[StepMeasurement] = None, window: Optional[WindowMeasurement] = None,
               gpu: Optional[GpuHealth] = None) -> None:
        """Replace the latest measurement(s). Thread-safe."""
        with self._lock:
            if step is not None:
                self.step = step
            if window is not None:
                self.window = window
            if gpu is not None:
                self.gpu = gpu

    def _gauge(self, name: str, doc: str, value: Optional[float], extra: Optional[Dict[str, str]] = None):
        labels = ["run", "rank"] + list((extra or {}).keys())
        g = GaugeMetricFamily(name, doc, labels=labels)
        if value is not None:
            g.add_metric([self.run_info.run, str(self.run_info.rank)] + list((extra or {}).values()), float(value))
        return g

    def collect(self) -> Iterable[Any]:
        with self._lock:
            step, window, gpu, ri = self.step, self.window, self.gpu, self.run_info
        base = [ri.run, str(ri.rank)]
        info = InfoMetricFamily(M.RUN_INFO.removesuffix("_info"),  # exposed as mfuwatch_run_info
                                "Static facts about the run (GPU, dtype, peak and its source, world size, versions)",
                                labels=["run", "rank"])
        info.add_metric(base, {
            "host": ri.host, "device": ri.device, "gpu": ri.gpu_name, "dtype": ri.dtype,
            "world_size": str(ri.world_size), "local_rank": str(ri.local_rank),
            "peak_source": ri.peak_source, "flops_source": ri.flops_source, "flops_convention": ri.flops_convention,
            "exporter_url": ri.exporter_url, **{f"{k}_version": v for k, v in ri.versions.items()},
        })
        yield info
        if ri.peak_flops_per_second:
            yield self._gauge(M.PEAK_FLOPS_PER_SECOND, "Peak FLOP/s of one device for the training dtype",
                              ri.peak_flops_per_second)
        if step is not None:
            if step.mfu is not None:
                yield self._gauge(M.MFU, "Model FLOPs utilization: model FLOPs per step / step time / peak FLOP/s",
                                  step.mfu)
            if step.hfu is not None:
                yield self._gauge(M.HFU, "Hardware FLOPs utilization: executed FLOPs (recomputation included) / "
                                         "step time / peak FLOP/s", step.hfu)
            yield self._gauge(M.MODEL_FLOPS_PER_SECOND, "Model FLOPs per second achieved", step.model_flops_per_second)
            yield self._gauge(M.TOKENS_PER_SECOND, "Training tokens per second", step.tokens_per_second)
            yield self._gauge(M.LAST_STEP_DURATION_SECONDS, "Mean optimizer-step time of the last report interval",
                              step.step_time_seconds)
            for name, doc, value in (
                    (M.INTERVAL_TENSOR_ACTIVE, "GPM tensor-core activity averaged over the last report interval's "
                     "steps", step.tensor_active),
                    (M.INTERVAL_TENSOR_ACTIVE_BOUND, "GPM tensor activity x SM clock / max SM clock averaged over "
                     "the last report interval's steps (MFU cannot exceed it)", step.tensor_active_bound),
                    (M.INTERVAL_SM_ACTIVE, "GPM SM activity averaged over the last report interval's steps",
                     step.sm_active),
                    (M.INTERVAL_DRAM_ACTIVE, "GPM DRAM activity averaged over the last report interval's steps",
                     step.dram_active)):
                if value is not None:
                    yield self._gauge(name, doc, value)
        stall = self.stall_seconds() if self.stall_seconds is not None else None
        if stall is not None:
            yield self._gauge(M.STALL_SECONDS, "Seconds since the last optimizer step or agent phase end "
                              "(monotonic clock; absent while a phase is open)", stall)
        # the step hook's per-step time; a report's (its last step's end) where no hook feeds the collector
        last = self.last_step_wall
        if step is not None and (last is None or step.timestamp > last):
            last = step.timestamp
        if last is not None:
            yield self._gauge(M.LAST_STEP_TIMESTAMP_SECONDS, "Unix time at which the last optimizer step ended "
                              "(set by the step hook at each step)", last)
        if window is not None:
            g = GaugeMetricFamily(M.GPU_TIME_SHARE, "Share of GPU busy time per category in the last profiler "
                                  "window (idle: share of wall time)", labels=["run", "rank", "category"])
            for cat, share in window.breakdown.items():
                g.add_metric(base + [cat], float(share))
            yield g
            yield self._gauge(M.MEMORY_BOUND_SHARE, "GPU time in memory-bound kernels / GPU busy time (last window)",
                              window.memory_bound_share)
            g = GaugeMetricFamily(M.OP_GPU_TIME_SHARE, "Share of GPU busy time of the top ops in the last window",
                                  labels=["run", "rank", "op", "bound"])
            for op in window.top_ops:
                g.add_metric(base + [op.op, op.bound], float(op.share))
            yield g
            g = GaugeMetricFamily(M.SUGGESTION_EXPECTED_GAIN, "Expected fraction of step time saved by a remedy "
                                  "(Amdahl)", labels=["run", "rank", "kernel"])
            for s in window.suggestions:
                g.add_metric(base + [s.kernel], float(s.expected_gain))
            yield g
            # the ranking (existing fixes first, then by expected gain) is not the order of the gains: the
            # alert rules name the first suggestion through this gauge, as the in-process engine does
            g = GaugeMetricFamily(M.SUGGESTION_ORDER, "Position of a remedy in the agent's ranking of the last "
                                  "window (1 = first: existing fixes first, then by expected gain)",
                                  labels=["run", "rank", "kernel"])
            for i, s in enumerate(window.suggestions, 1):
                g.add_metric(base + [s.kernel], float(i))
            yield g
            yield self._gauge(M.KERNELS_PER_STEP, "GPU kernels launched per optimizer step (last window)",
                              window.kernels_per_step)
            yield self._gauge(M.MEAN_KERNEL_DURATION_SECONDS, "Mean GPU kernel duration (last window)",
                              window.mean_kernel_seconds)
        if gpu is not None:
            yield from self._gpu(gpu, base)

    def _gpu(self, gpu: GpuHealth, base) -> Iterable[Any]:
        simple = (
            (M.GPU_UTILIZATION, "NVML GPU utilization (share of time a kernel ran)", gpu.utilization),
            (M.GPU_MEMORY_UTILIZATION, "NVML memory utilization (share of time device memory was read or written)",
             gpu.memory_bandwidth_utilization),
            (M.GPU_SM_CLOCK_HERTZ, "SM clock", gpu.sm_clock_hertz),
            (M.GPU_SM_CLOCK_MAX_HERTZ, "Maximum SM clock (NVML)", gpu.sm_clock_max_hertz),
            (M.GPU_POWER_WATTS, "Board power draw", gpu.power_watts),
            (M.GPU_POWER_LIMIT_WATTS, "Enforced power limit", gpu.power_limit_watts),
            (M.GPU_TEMPERATURE_CELSIUS, "GPU temperature", gpu.temperature_celsius),
            (M.GPU_MEMORY_USED_BYTES, "Device memory used", gpu.memory_used_bytes),
            (M.GPU_MEMORY_TOTAL_BYTES, "Device memory total", gpu.memory_total_bytes),
            (M.GPU_SM_ACTIVE, "GPM SM activity ratio", gpu.sm_active),
            (M.GPU_TENSOR_ACTIVE, "GPM tensor-core activity ratio (cross-check for MFU)", gpu.tensor_active),
            (M.GPU_DRAM_ACTIVE, "GPM DRAM bandwidth utilization ratio", gpu.dram_active),
        )
        for name, doc, v in simple:
            if v is not None:
                yield self._gauge(name, doc, v)
        if gpu.energy_joules is not None:
            from prometheus_client.core import CounterMetricFamily

            c = CounterMetricFamily(M.GPU_ENERGY_JOULES_TOTAL, "Energy consumed since the driver loaded",
                                    labels=["run", "rank"])
            c.add_metric(base, gpu.energy_joules)
            yield c
        if gpu.clock_event_reasons:
            g = GaugeMetricFamily(M.GPU_CLOCK_EVENT_REASON, "1 when NVML reports this clock-event (throttle) reason",
                                  labels=["run", "rank", "reason"])
            for reason, active in gpu.clock_event_reasons.items():
                g.add_metric(base + [reason], 1.0 if active else 0.0)
            yield g
        from prometheus_client.core import CounterMetricFamily

        c = CounterMetricFamily(M.GPU_XID_ERRORS_TOTAL, "Xid critical errors seen by the sampler",
                                labels=["run", "rank"])
        c.add_metric(base, float(gpu.xid_errors))
        yield c
        if gpu.ecc_errors:
            c = CounterMetricFamily(M.GPU_ECC_ERRORS_TOTAL, "ECC errors (volatile)", labels=["run", "rank", "type"])
            for typ, n in gpu.ecc_errors.items():
                c.add_metric(base + [typ], float(n))
            yield c


class ServerCollector(Collector):
    """The exporter server's self-monitoring: requests by status, dropped connections by reason, CPU seconds.

    Series: one per status of :data:`~.http_server.STATUSES` (a fixed set), one per drop reason seen (a
    bounded set: ``over_cap``, ``timeout_<state>``, ``io_<state>``, ``tls_wrap``, ``accept_<errno>``; none
    in a healthy run), one CPU counter.

    ``stats`` returns :meth:`Exporter.server_stats`'s mapping (or ``None`` before the server starts: no
    series). In process mode the counts come from the server child's last stats line (at most a second
    old); the CPU seconds are then the whole child's, in thread mode the loop thread's.
    """

    def __init__(self, run_info: RunInfo, stats: Callable[[], Optional[Dict[str, Any]]]) -> None:
        self.run_info = run_info
        self._stats = stats

    def describe(self) -> Iterable[Any]:
        return []  # registration must not collect (the server starts later)

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily

        st = self._stats()
        if not st:
            return
        from .http_server import STATUSES

        base = [self.run_info.run, str(self.run_info.rank)]
        c = CounterMetricFamily(M.EXPORTER_REQUESTS_TOTAL, "Requests the exporter's server answered, by HTTP status",
                                labels=["run", "rank", "code"])
        answered = {str(k): v for k, v in (st.get("answered") or {}).items()}
        for code in STATUSES:  # a fixed set of series, 0 until a request gets that status
            c.add_metric(base + [str(code)], float(answered.get(str(code), 0)))
        yield c
        c = CounterMetricFamily(M.EXPORTER_DROPPED_CONNECTIONS_TOTAL, "Connections the exporter's server dropped "
                                "(over the connection cap, timeouts, I/O errors)", labels=["run", "rank", "reason"])
        for why, n in sorted((st.get("dropped") or {}).items()):
            c.add_metric(base + [str(why)], float(n))
        yield c
        c = CounterMetricFamily(M.EXPORTER_SERVER_CPU_SECONDS_TOTAL, "CPU seconds of the exporter's server (the "
                                "server child process; the loop thread in thread mode)", labels=["run", "rank"])
        c.add_metric(base, float(st.get("cpu_seconds") or 0.0))
        yield c


class GuardedRegistry:
    """What the HTTP server scrapes: ``registry``'s collectors, each under its own guard.

    prometheus-client's exposition calls ``registry.collect()``, so one collector
    that raises turns every scrape into an HTTP 500 with a traceback. Here a
    failing collector is skipped for that scrape and reported to ``on_error``
    (the agent counts it as ``agent_errors_total{component="collector"}`` and logs
    it once); the other metrics are still served.
    """

    def __init__(self, registry: CollectorRegistry, on_error: Optional[Callable[[str, BaseException], None]]):
        self.registry = registry
        self.on_error = on_error

    def _collectors(self) -> list:
        lock = getattr(self.registry, "_lock", None)
        names = getattr(self.registry, "_collector_to_names", None)
        if lock is None or names is None:  # another prometheus-client layout: one guard for the whole scrape
            return [self.registry]
        with lock:
            return list(names)

    def collect(self) -> Iterable[Any]:
        for c in self._collectors():
            try:
                metrics = list(c.collect())
            except Exception as exc:  # noqa: BLE001 - one broken collector must not fail the scrape
                from .http_server import report_error

                report_error(self.on_error, "collector", exc)
                continue
            yield from metrics

    def restricted_registry(self, names: Iterable[str]) -> Any:
        """The ``?name[]=`` filter of the exposition handler."""
        names = set(names)
        outer = self

        class _Restricted:
            def collect(self) -> Iterable[Any]:
                for m in outer.collect():
                    samples = [s for s in m.samples if s.name in names]
                    if samples:
                        m.samples = samples
                        yield m

        return _Restricted()


class Exporter:
    """Owns the registry, the counters/histogram and the HTTP server of one agent.

    Args:
        run_info: labels and static facts.
        registry: a fresh ``CollectorRegistry`` by default (never the global one,
            so several agents or tests in one process don't collide).
    """

    def __init__(self, run_info: RunInfo, registry: Optional[CollectorRegistry] = None) -> None:
        self.run_info = run_info
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.collector = MeasurementCollector(run_info)
        self.registry.register(self.collector)
        self.registry.register(ServerCollector(run_info, lambda: self.server_stats()))
        lab = ["run", "rank"]
        self.step_hist = Histogram(M.STEP_DURATION_SECONDS, "Optimizer-step time", lab, buckets=STEP_BUCKETS,
                                   registry=self.registry)
        self.steps = Counter(M.STEPS_TOTAL.removesuffix("_total"), "Optimizer steps", lab, registry=self.registry)
        self.tokens = Counter(M.TOKENS_TOTAL.removesuffix("_total"), "Training tokens (all micro-batches)", lab,
                              registry=self.registry)
        self.errors = Counter(M.AGENT_ERRORS_TOTAL.removesuffix("_total"), "Exceptions caught inside the agent",
                              lab + ["component"], registry=self.registry)
        self.windows = Counter(M.PROFILE_WINDOWS_TOTAL.removesuffix("_total"), "Profiler windows by outcome",
                               lab + ["outcome"], registry=self.registry)
        self._base = (run_info.run, str(run_info.rank))
        self._server = None
        self.cache = None
        self.url = ""
        #: "process" or "thread" once serving (see :meth:`serve`); times the server child could not start
        self.mode = ""
        self.fallbacks = 0
        #: Told ``("collector", exc)`` of a collector that failed during a scrape (the agent's error counter).
        self.on_error: Optional[Callable[[str, BaseException], None]] = None
        #: what /metrics serves: the registry, each collector under its own guard (the agent wraps it in a
        #: `job`-labelled view)
        self.exposed_registry: Any = GuardedRegistry(self.registry, self._on_error)
        # Touch the label sets so the series exist (at 0) from the first scrape.
        self.steps.labels(*self._base)
        self.tokens.labels(*self._base)

    def _on_error(self, component: str, exc: BaseException) -> None:
        if self.on_error is not None:
            self.on_error(component, exc)

    def count_error(self, component: str) -> None:
        self.errors.labels(*self._base, component).inc()

    def count_window(self, outcome: str) -> None:
        self.windows.labels(*self._base, outcome).inc()

    def observe_steps(self, steps: int, tokens: int, step_seconds: Optional[float]) -> None:
        """Add ``steps`` optimizer steps and ``tokens`` tokens; observe the mean step time once per step."""
        self.steps.labels(*self._base).inc(steps)
        self.tokens.labels(*self._base).inc(tokens)
        if step_seconds is not None and step_seconds == step_seconds:  # not NaN
            h = self.step_hist.labels(*self._base)
            for _ in range(steps):
                h.observe(step_seconds)

    def serve(self, port: int, bind: str, certfile: Optional[str] = None, keyfile: Optional[str] = None,
              tries: int = 100, *, auth: Any = None, max_connections: int = 256, read_timeout_s: float = 10.0,
              handshake_timeout_s: float = 5.0, max_cpu_share: float = 0.03,
              render_interval_s: float = 0.5, mode: str = "process", server_cpus: Optional[list] = None) -> str:
        """Start the HTTP(S) server on ``port`` or, if busy, the next free port (up to ``tries`` ports).

        ``mode="process"`` (the default): a server child process
        (:class:`~mfuwatch.agent.live.server_process.ProcessServer`) answers every request, and this
        process only renders the exposition of :attr:`exposed_registry` (at most every
        ``render_interval_s`` seconds while scraped, after reports and events) on a publisher thread;
        when the child cannot start, the in-process server is used instead (counted as
        ``agent_errors_total{component="exporter_process"}``, logged once). ``mode="thread"``: the
        in-process event-loop thread (:class:`~mfuwatch.agent.live.http_server.MetricsServer`).
        ``server_cpus``: the CPU numbers the server child runs on (every thread of it; ``None``: this
        process's affinity, inherited; ignored by the thread server, which is part of this process). ``auth``
        is an :class:`~mfuwatch.agent.live.http_server.Auth` or ``None``; the other arguments bound what
        a client can hold (see :class:`~mfuwatch.agent.live.http_server.MetricsServer`).

        Returns the URL of ``/metrics``. Raises ``OSError`` if no port in the range is free, and
        ``ssl.SSLError`` (an ``OSError``) if the certificate or key does not load.
        """
        import ssl

        from prometheus_client import generate_latest

        from .http_server import ExpositionCache, MetricsServer

        ctx = None
        if certfile:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(certfile, keyfile)  # here, so a bad file fails as before in both modes

        def render() -> bytes:
            return generate_latest(self.exposed_registry)

        if mode == "process":
            from .server_process import ChildUnavailable, ProcessServer

            server = ProcessServer(render, bind, port, tries=1 if port == 0 else tries, certfile=certfile,
                                   keyfile=keyfile, auth=auth, min_interval_s=render_interval_s,
                                   max_connections=max_connections, read_timeout_s=read_timeout_s,
                                   handshake_timeout_s=handshake_timeout_s, max_cpu_share=max_cpu_share,
                                   on_error=self._on_error, cpus=server_cpus)
            try:
                server.start()
            except ChildUnavailable as exc:
                self.fallbacks += 1
                self._on_error("exporter_process", exc)  # counted, logged once; the thread server serves
            else:
                self._server, self.mode = server, "process"
                return self._set_url(port, server.server_address[1], bind, certfile)
        self.cache = ExpositionCache(render, render_interval_s, on_error=self._on_error)
        last: Optional[OSError] = None
        candidates = [0] if port == 0 else range(port, min(port + tries, 65536))
        for p in candidates:
            server = MetricsServer(self.cache, bind, p, ssl_context=ctx, auth=auth, max_connections=max_connections,
                                   read_timeout_s=read_timeout_s, handshake_timeout_s=handshake_timeout_s,
                                   max_cpu_share=max_cpu_share, on_error=self._on_error)
            try:
                server.start()
            except OSError as exc:
                if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                    raise
                last = exc
                continue
            self._server, self.mode = server, "thread"
            return self._set_url(port, server.server_address[1], bind, certfile)
        raise OSError(errno.EADDRINUSE, f"no free port in {port}..{port + tries - 1} for the mfuwatch exporter") from last

    def _set_url(self, port: int, actual: int, bind: str, certfile: Optional[str]) -> str:
        if port and actual != port:
            log.warning("mfuwatch: port %d is busy; the exporter serves on port %d instead", port, actual)
        scheme = "https" if certfile else "http"
        host = bind if bind not in ("0.0.0.0", "::", "") else "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        self.url = f"{scheme}://{host}:{actual}/metrics"
        return self.url

    def refresh(self, force: bool = False) -> None:
        """Render the exposition soon if scrapes read the last render (the agent thread, after a report: at
        most two renders per render interval this way), or always with ``force`` (an event: a notification
        outcome, a signal); no-op without a server. In process mode the render runs on the publisher thread."""
        server = self._server
        if server is None:
            return
        if self.mode == "process":
            server.refresh() if force else server.refresh_if_read()
        elif self.cache is not None:
            self.cache.refresh() if force else self.cache.refresh_if_read()

    @property
    def renders(self) -> int:
        """Renders of the exposition so far (either mode; 0 without a server)."""
        server = self._server
        if self.mode == "process" and server is not None:
            return server.renders
        return self.cache.renders if self.cache is not None else 0

    def server_stats(self) -> Optional[Dict[str, Any]]:
        """The server's self-monitoring counters (``answered``, ``dropped``, ``cpu_seconds``,
        ``throttled_seconds``; see :meth:`~mfuwatch.agent.live.http_server.MetricsServer.stats`), or ``None``."""
        server = self._server
        return server.stats() if server is not None else None

    def forget_after_fork(self) -> None:
        """In a forked child: drop the server's sockets without stopping the parent's server."""
        server, self._server = self._server, None
        if server is not None:
            server.forget_after_fork()

    def close(self, timeout: float = 1.0) -> None:
        """A final render (scrapes during the rest of the close see the final counts), then stop the HTTP
        server; returns within ``timeout`` seconds whatever the clients do. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        if self.mode == "thread" and self.cache is not None:
            self.cache.refresh()
        server.close(timeout)  # the process server renders its final bytes itself (within its bound)
