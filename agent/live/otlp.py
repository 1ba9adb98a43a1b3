"""Optional OTLP export: the agent's series through the OpenTelemetry metrics SDK, same names and labels.

For teams whose metrics go through an OpenTelemetry Collector rather than a
Prometheus scrape. Install the extra (``pip install 'mfuwatch[otlp]'``: the
SDK and the OTLP/HTTP exporter) and set the agent's ``otlp_endpoint`` (e.g.
``http://collector:4318/v1/metrics``); the Prometheus exporter keeps working
beside it.

Each Prometheus sample name of :class:`mfuwatch.agent.schema.M` becomes one
asynchronous instrument of the same name: counters (``*_total``, the histogram's
``_bucket``/``_sum``/``_count``) as ``ObservableCounter`` (cumulative), everything
else as ``ObservableGauge``; the sample's labels (``run``, ``rank``, ``job`` and the
extra labels, ``le`` for buckets) become the data point's attributes. The
values are read from the same ``job``-labelled registry view the HTTP exporter
serves, once per export cycle (cached 0.5 s across the instruments' callbacks),
so both paths always agree. ``_created`` samples are Prometheus-only and left out.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..schema import M

_HISTOGRAMS = (M.STEP_DURATION_SECONDS,)


def sample_names() -> List[str]:
    """Every Prometheus sample name the agent can export (histograms expanded)."""
    out = []
    for k, v in vars(M).items():
        if not k.isupper():
            continue
        if v in _HISTOGRAMS:
            out += [v + "_bucket", v + "_sum", v + "_count"]
        else:
            out.append(v)
    return out


def _is_counter(name: str) -> bool:
    return name.endswith(("_total", "_bucket", "_count", "_sum")) and name != M.RUN_INFO


class OtlpBridge:
    """Asynchronous OpenTelemetry instruments reading a Prometheus registry (view).

    Args:
        source: an object with ``collect()`` (the agent's ``exporter.exposed_registry``).
        meter_provider: an SDK ``MeterProvider`` (tests pass one with an in-memory reader);
            default: a new one exporting to ``endpoint`` over OTLP/HTTP every ``export_interval_seconds``.
        endpoint: the collector's OTLP/HTTP metrics URL (only without ``meter_provider``).

    Raises:
        ImportError: the OpenTelemetry SDK (or, without ``meter_provider``, its OTLP exporter) is missing;
            the message names the extra to install.
    """

    def __init__(self, source: Any, meter_provider: Any = None, *, endpoint: Optional[str] = None,
                 export_interval_seconds: float = 15.0) -> None:
        try:
            from opentelemetry.metrics import Observation
            from opentelemetry.sdk.metrics import MeterProvider
        except ImportError as exc:
            raise ImportError("OTLP export needs the OpenTelemetry SDK: pip install 'mfuwatch[otlp]'") from exc
        self._own = meter_provider is None
        if meter_provider is None:
            try:
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
                from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
            except ImportError as exc:
                raise ImportError("OTLP export needs the OTLP/HTTP exporter: pip install 'mfuwatch[otlp]'") from exc
            reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint),
                                                   export_interval_millis=export_interval_seconds * 1000)
            meter_provider = MeterProvider(metric_readers=[reader])
        self.provider = meter_provider
        self._source = source
        self._lock = threading.Lock()
        self._cache: Tuple[float, Dict[str, List[Tuple[Dict[str, str], float]]]] = (0.0, {})
        self._observation = Observation
        meter = meter_provider.get_meter("mfuwatch")
        for name in sample_names():
            make = meter.create_observable_counter if _is_counter(name) else meter.create_observable_gauge
            make(name, callbacks=[self._callback(name)])

    def _samples(self) -> Dict[str, List[Tuple[Dict[str, str], float]]]:
        with self._lock:
            at, cached = self._cache
            if time.monotonic() - at < 0.5:
                return cached
            out: Dict[str, List[Tuple[Dict[str, str], float]]] = {}
            for family in self._source.collect():
                for s in family.samples:
                    if s.name.endswith("_created"):
                        continue
                    out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
            self._cache = (time.monotonic(), out)
            return out

    def _callback(self, name: str):
        def observe(options: Any) -> Iterable[Any]:
            return [self._observation(v, attributes=labels) for labels, v in self._samples().get(name, [])]

        return observe

    def close(self) -> None:
        """Flush and shut down the meter provider this bridge created (not one it was given)."""
        if self._own:
            self.provider.shutdown()
