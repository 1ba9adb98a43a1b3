"""OTLP export: the OpenTelemetry SDK's in-memory reader sees the same names, labels and values as /metrics."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("opentelemetry.sdk.metrics")

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from prometheus_client.exposition import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from mfuwatch.agent import Agent  # noqa: E402
from mfuwatch.agent.live.otlp import OtlpBridge  # noqa: E402


def _otel_points(reader):
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    out[(m.name, tuple(sorted(p.attributes.items())))] = p.value
    return out


def test_otlp_points_equal_the_prometheus_samples():
    agent = Agent(config=dict(exporter=False, nvml=False, profile_every="off", alerts=False, flops_per_step=3e9,
                              peak_flops=1e13, run="otlp", job="otlp-job", report_every_steps=2))
    for _ in range(6):
        agent.step(tokens=128)
        time.sleep(0.01)
    deadline = time.time() + 10
    while agent.latest is None and time.time() < deadline:
        time.sleep(0.05)
    view = agent.exporter.exposed_registry
    reader = InMemoryMetricReader()
    bridge = OtlpBridge(view, MeterProvider(metric_readers=[reader]))
    otel = _otel_points(reader)
    prom = {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(generate_latest(view).decode())
            for s in fam.samples if not s.name.endswith("_created")}
    agent.close()
    bridge.close()
    assert prom and set(otel) == set(prom)
    for key, value in prom.items():
        if key[0] == "mfuwatch_stall_seconds":  # a clock read at each collection: the two reads are apart
            assert 0.0 <= value - otel[key] < 5.0, key
            continue
        assert otel[key] == pytest.approx(value), key
    steps = otel[("mfuwatch_steps_total", (("job", "otlp-job"), ("rank", "0"), ("run", "otlp")))]
    assert steps == 6
    # the FLOPs of the timed steps: the first step has no step time (the job MFU divides by it)
    assert otel[("mfuwatch_model_flops_total", (("job", "otlp-job"), ("rank", "0"), ("run", "otlp")))] == 5 * 3e9
