"""Every PromQL expression of every dashboard, run through a real Prometheus scraping real agents.

Set-up (once for the module): Debian's ``prometheus`` on 127.0.0.1 scrapes, every second,

* ``mfuwatch demo`` (a real CPU training run with the agent attached, 100 steps so windows analysed in the
  background land while it still serves, profiler windows every
  5 steps) for the Training MFU and Cross-rank dashboards, and
* an exporter in this process fed by the agent's NVML sampler over the fake pynvml of
  tests/helpers/fake_nvml.py (no GPU here), for the GPU health dashboard: on the CPU the demo
  has no NVML series, so this second run label, ``gpu-health-fixture``, stands in for a GPU.

Each panel target, annotation and variable query is then executed over the demo's lifetime
through Prometheus's HTTP API, with Grafana's variables substituted, and must return a
finite value; series must carry the labels their legend names. The fleet recording rules
(alerts/fleet_rules.py, 10 s windows) are loaded so that the recorded series the dashboards read exist. Empty results mean a metric
or label name in a dashboard does not match what the exporter writes. Prometheus evaluates
one test alerting rule so that the ``ALERTS`` annotation has series to find.
The demo's own HTML report is opened in headless Chromium at the end.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from mfuwatch.agent.exporter import Exporter
from mfuwatch.agent.nvml import NvmlSampler
from mfuwatch.agent.schema import RunInfo
from mfuwatch.alerts.fleet_rules import render_fleet
from tests.helpers.debian_tools import ensure_binary
from tests.helpers.fake_nvml import FakeNvml, make_gpus
from tests.helpers.grafana_dashboards import (REPO, Query, legend_labels, load_dashboards, parse_label_values,
                                              queries, substitute)
from tests.helpers.net import free_port

pytestmark = pytest.mark.slow

ARTIFACTS = REPO / "test-artifacts"
DEMO_RUN = "grafana-e2e-demo"
GPU_RUN = "gpu-health-fixture"
SCRAPE_SECONDS = 1
#: Grafana sets $__rate_interval to max(4 × scrape interval, step + scrape interval); the demo lives
#: for a few seconds only, so the test uses a window that surely holds two scrapes of it.
RATE_INTERVAL = "10s"
#: Which run label feeds each dashboard (the GPU health panels need NVML, which only the fixture has).
RUN_FOR = {"training-mfu.json": DEMO_RUN, "cross-rank.json": DEMO_RUN, "gpu-health.json": GPU_RUN}


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"prometheus exited with {proc.returncode}"
        try:
            if requests.get(url + "/-/ready", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise AssertionError("prometheus did not become ready")


class FakeGpuTarget:
    """An exporter serving NVML samples of a fake H200 that works hard, power-capped, with one Xid."""

    def __init__(self, port: int) -> None:
        self.fake = FakeNvml(make_gpus(1))
        g = self.fake.gpus[0]
        g.util_gpu, g.util_memory, g.sm_clock_mhz, g.temperature_c = 97, 58, 1755, 71
        g.power_mw, g.power_limit_mw, g.memory_used = 690_000, 700_000, 118 * 2**30
        g.clock_event_mask = self.fake.nvmlClocksEventReasonSwPowerCap
        g.ecc_corrected = 2
        g.xid_queue.append(79)  # "GPU has fallen off the bus"
        self.exporter = Exporter(RunInfo(run=GPU_RUN, rank=0, host="fake-gpu-node", device="cuda:0",
                                         gpu_name="NVIDIA H200", dtype="bf16"))
        self.errors: list = []
        self.sampler = NvmlSampler(torch_device=0, interval_seconds=0.25, nvml=self.fake,
                                   on_sample=lambda h: self.exporter.collector.update(gpu=h),
                                   on_error=lambda c, e: self.errors.append((c, repr(e))))
        self._stop = threading.Event()
        self._driver = threading.Thread(target=self._advance, daemon=True)
        self.exporter.serve(port, "127.0.0.1")
        assert self.sampler.start(), "the NVML sampler did not open the fake"
        self._driver.start()

    def _advance(self) -> None:  # the "GPU" keeps working: energy and GPM counters move on
        g = self.fake.gpus[0]
        while not self._stop.wait(0.1):
            g.energy_mj += 690 * 100  # 690 W for 0.1 s, in mJ
            g.gpm_clock_seconds += 0.1
            for key, share in (("sm", 0.93), ("tensor", 0.47), ("dram", 0.36)):
                g.gpm_busy_seconds[key] += 0.1 * share

    def close(self) -> None:
        self._stop.set()
        self._driver.join(2)
        self.sampler.close()
        self.exporter.close()


@dataclass
class Stack:
    prometheus: str  # base URL
    start: float
    end: float
    demo_dir: Path
    demo_output: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    prometheus = ensure_binary(("prometheus",), "prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    demo_port, gpu_port, prom_port = free_port(), free_port(), free_port()
    gpu = FakeGpuTarget(gpu_port)
    (tmp / "test.rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "grafana-e2e", "rules": [
        {"alert": "GrafanaEndToEndProbe", "expr": "mfuwatch_run_info == 1", "labels": {"severity": "info"},
         "annotations": {"summary": "always firing: gives the ALERTS annotation query series to find"}}]}]}))
    # the fleet recording rules feed the dashboards' recorded series (windows short enough for the demo's life)
    (tmp / "fleet.rules.yml").write_text(render_fleet(window_seconds=10, goodput_window_seconds=10))
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE_SECONDS}s", "evaluation_interval": f"{SCRAPE_SECONDS}s"},
        "rule_files": [str(tmp / "test.rules.yml"), str(tmp / "fleet.rules.yml")],
        "scrape_configs": [{"job_name": "mfuwatch", "static_configs": [
            {"targets": [f"127.0.0.1:{demo_port}", f"127.0.0.1:{gpu_port}"]}]}]}))
    url = f"http://127.0.0.1:{prom_port}"
    log = open(tmp / "prometheus.log", "w")
    prom = subprocess.Popen([prometheus, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}", f"--storage.tsdb.path={tmp / 'data'}"],
                            stdout=subprocess.DEVNULL, stderr=log)
    try:
        try:
            _wait_ready(url, prom)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{(tmp / 'prometheus.log').read_text()[-3000:]}") from None
        demo_dir = tmp / "demo"
        # An alert must fire during the run so the dashboards' alert annotations have a series to find:
        # the memory-bound rule with threshold 0 fires at the first profiler window (console notifier).
        agent_cfg = tmp / "agent.yaml"
        agent_cfg.write_text(yaml.safe_dump({"alerts": {"evaluation_interval": "500ms", "rules": {
            "MemoryBoundDominant": {"threshold": 0.0, "for": "0s"}}}}))
        start = time.time()
        demo = subprocess.run(
            [sys.executable, "-m", "mfuwatch.agent.cli", "demo", "--steps", "100", "--device", "cpu",
             "--port", str(demo_port), "--profile-every", "5 steps", "--run", DEMO_RUN, "--config", str(agent_cfg),
             "--timeline", str(demo_dir / "timeline.jsonl"), "--report", str(demo_dir / "report.html")],
            capture_output=True, text=True, timeout=400, cwd=tmp)
        end = time.time()
        out = demo.stdout + demo.stderr
        assert demo.returncode == 0, out[-4000:]
        assert f"127.0.0.1:{demo_port}/metrics" in out, "the demo did not serve on the port Prometheus scrapes"
        time.sleep(2 * SCRAPE_SECONDS)  # let the last GPU-fixture scrapes and rule evaluations land
        yield Stack(url, start, time.time(), demo_dir, out)
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=20)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        log.close()
        gpu.close()


def _range(stack: Stack, expr: str) -> list:
    r = requests.get(stack.prometheus + "/api/v1/query_range", timeout=30,
                     params={"query": expr, "start": stack.start, "end": stack.end, "step": SCRAPE_SECONDS})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}\n{body}"
    return body["data"]["result"]


def _cases():
    out = []
    for name, dash in load_dashboards().items():
        for q in queries(name, dash):
            out.append(pytest.param(q, id=f"{name}:{q.where}"))
    return out


@pytest.mark.parametrize("query", _cases())
def test_query_returns_data_from_the_agent(stack, query: Query):
    run = RUN_FOR[query.dashboard]
    variables = {"run": run, "rank": ".*"}
    if query.kind == "label_values":
        selector, label = parse_label_values(query.expr)
        r = requests.get(f"{stack.prometheus}/api/v1/label/{label}/values", timeout=30,
                         params={"match[]": substitute(selector, variables, RATE_INTERVAL),
                                 "start": stack.start, "end": stack.end}).json()
        assert r["status"] == "success", r
        expected = {"run": {DEMO_RUN, GPU_RUN}, "rank": {"0"}}[label]
        assert expected <= set(r["data"]), f"{query.where}: {label} values {r['data']}"
        return
    expr = substitute(query.expr, variables, RATE_INTERVAL)
    result = _range(stack, expr)
    assert result, f"{query.dashboard} {query.where}: no series for\n  {expr}"
    finite = [float(v) for s in result for _, v in s["values"] if math.isfinite(float(v))]
    assert finite, f"{query.dashboard} {query.where}: only NaN/Inf for\n  {expr}"
    for series in result:
        missing = [lab for lab in legend_labels(query.legend) if lab not in series["metric"]]
        assert not missing, f"{query.where}: legend {query.legend!r} names labels {missing} the series lack"
    if "run=~" in query.expr and query.legend.find("{{run}}") < 0:
        assert all(s["metric"].get("run", run) == run for s in result), f"{query.where}: other runs leaked in"


def test_gpu_fixture_went_through_the_real_sampler(stack):
    """The GPU panels read what the NVML sampler made of the fake: spot-check the conversions."""
    def value(expr):
        (s,) = _range(stack, expr)
        return float(s["values"][-1][1])

    sel = f'{{run="{GPU_RUN}"}}'
    assert value(f"mfuwatch_gpu_power_watts{sel}") == 690.0  # 690 000 mW
    assert value(f"mfuwatch_gpu_sm_clock_hertz{sel}") == 1755e6  # 1755 MHz
    assert value(f"mfuwatch_gpu_utilization_ratio{sel}") == pytest.approx(0.97)
    assert value(f"mfuwatch_gpu_tensor_active_ratio{sel}") == pytest.approx(0.47, abs=0.02)
    assert value(f"mfuwatch_gpu_xid_errors_total{sel}") == 1.0
    assert value(f'mfuwatch_gpu_clock_event_reason{{run="{GPU_RUN}", reason="sw_power_cap"}}') == 1.0


def test_the_demo_report_renders_in_headless_chromium(stack):
    from PIL import Image

    from tests.helpers.headless_chromium import open_page

    report = stack.demo_dir / "report.html"
    assert report.is_file(), stack.demo_output[-2000:]
    res = open_page(report, ARTIFACTS / "demo-report.png")
    assert res.console == [], res.console
    assert res.dom.count('class="plot-container plotly"') == 6  # no GPU on the CPU: no GPU-health chart
    assert DEMO_RUN in res.dom
    with Image.open(res.screenshot) as im:
        assert len(im.convert("RGB").getcolors(maxcolors=1 << 24)) > 200
