"""The scale path with real parts: 32 ranks -> Prometheus (agent mode, file_sd) -> remote_write -> VictoriaMetrics,
rules evaluated by vmalert against VictoriaMetrics, alerts through a real Alertmanager to a local receiver.

Everything runs on 127.0.0.1, installed from Debian (``prometheus``, ``prometheus-alertmanager``,
``victoria-metrics``, which ships ``vmalert``) and started here. The ranks are
``tests/helpers/fleet_rank.py`` processes (a step loop of 0.1 s steps, real exporters and fleet accounting,
no torch) that register through the agent's own file-SD target files.

Checks, in order:

1. every rank's series reach VictoriaMetrics with ``job``/``run``/``rank``, within the per-rank budget;
2. job MFU recorded by vmalert (``job:mfuwatch_mfu:ratio``) equals the mean of the ranks' own MFU gauges
   within 1%, and the raw PromQL expression queried from VictoriaMetrics agrees with the recorded series;
3. a straggler (rank 7 made 30% slower) raises ``StragglerRank{kind="chronic"}`` naming rank 7 and its
   host, a hang (rank 13 stops stepping) raises ``TrainingStalled{kind="fleet"}`` naming rank 13, its host
   and the frame its training thread waits in, and a slow input pipeline (rank 21 waits half of each
   unchanged 0.1 s step for input) raises ``InputBoundRank`` naming rank 21 and its host; each within its
   window/threshold + ``for`` + two scrape intervals + the pipeline's own cadence (remote-write flush,
   rule evaluation, Alertmanager group wait). The three faults start together, so the third costs no
   extra wall time. Then rank 27 opens an eval phase that never ends and rank 29 runs an eval of 2x the
   stall threshold and steps on: neither may be named by ``TrainingStalled`` (the rules pause during
   phases and restart their clock at a phase's end). This comes after the other checks because a rank in
   an eval waits for no input, so it lowers the job's least input-wait share that ``InputBoundRank``
   compares with;
4. the memory (RSS from /proc) of Prometheus and VictoriaMetrics, written to ``test-artifacts/fleet_scale.json``
   for docs/fleet.md together with the fault-to-notification times.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from mfuwatch.alerts.fleet_rules import render_fleet
from tests.helpers.debian_tools import ensure_binary
from tests.helpers.net import free_port
from tests.helpers.receiver import AlertReceiver

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
RANKS = 32
STEP = 0.1
FLOPS, PEAK = 2e10, 1e12  # MFU 0.2 at 0.1 s steps
RUN, JOB = "fleet-scale", "fleet-scale-job"
STRAGGLER, HUNG, INPUT_BOUND = 7, 13, 21
IN_EVAL, EVAL_THEN_STEP = 27, 29  # an eval that never ends; an eval of EVAL_SECONDS, then steps again
SCRAPE = 1.0  # seconds
EVAL = 1.0
WINDOW = 10.0  # rate() window of the recording rules
STRAGGLER_FOR = 5.0
STALLED = 4.0  # TrainingStalled: seconds without a step
EVAL_SECONDS = 2 * STALLED
INPUT_FOR = 5.0  # InputBoundRank's for (its share is over the 10 s window)
#: The pipeline's own cadence on top of the rule's condition: remote-write flush (1 s), vmalert's
#: evaluation (1 s), Alertmanager's group wait (1 s) and the rank's report interval (10 steps = 1 s).
PIPELINE = 4.0


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Proc:
    def __init__(self, name: str, args: list, log_dir: Path) -> None:
        self.name = name
        self.log = open(log_dir / f"{name}.log", "w")
        self.p = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


def _wait(what: str, fn, timeout: float, procs=()) -> object:
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        for pr in procs:
            assert pr.p.poll() is None, f"{pr.name} exited ({pr.p.returncode}):\n{pr.tail()}"
        try:
            last = fn()
            if last:
                return last
        except (requests.RequestException, KeyError, ValueError, IndexError) as exc:
            last = exc
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}: last={last!r}\n" +
                         "\n".join(f"--- {p.name}\n{p.tail()}" for p in procs))


def _query(base: str, expr: str) -> list:
    r = requests.get(base + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body.get("status") == "success", (expr, body)
    return body["data"]["result"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    prometheus = ensure_binary(("prometheus",), "prometheus")
    alertmanager = ensure_binary(("prometheus-alertmanager", "alertmanager"), "prometheus-alertmanager")
    vm = ensure_binary(("victoria-metrics",), "victoria-metrics")
    vmalert = ensure_binary(("vmalert",), "victoria-metrics")
    tmp = tmp_path_factory.mktemp("fleet")
    sd = tmp / "targets"
    sd.mkdir()
    vm_port, prom_port, am_port, vmalert_port = free_port(), free_port(), free_port(), free_port()
    vm_url, am_url = f"http://127.0.0.1:{vm_port}", f"http://127.0.0.1:{am_port}"
    rx = AlertReceiver().start()
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE:g}s", "scrape_timeout": "900ms"},
        "scrape_configs": [{"job_name": "mfuwatch", "honor_labels": True,
                            "file_sd_configs": [{"files": [str(sd / "*.json")], "refresh_interval": "1s"}]}],
        "remote_write": [{"url": f"{vm_url}/api/v1/write",
                          "queue_config": {"batch_send_deadline": "500ms", "max_samples_per_send": 10000}}]}))
    (tmp / "fleet.rules.yml").write_text(render_fleet(
        window_seconds=WINDOW, goodput_window_seconds=WINDOW, straggler_for_seconds=STRAGGLER_FOR,
        stalled_seconds=STALLED, goodput_threshold=0.5, goodput_for_seconds=30.0, input_wait_for_seconds=INPUT_FOR))
    (tmp / "alertmanager.yml").write_text(yaml.safe_dump({
        "route": {"receiver": "hook", "group_by": ["alertname", "rank"], "group_wait": "1s",
                  "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "hook", "webhook_configs": [{"url": rx.url, "send_resolved": True}]}]}))
    procs = [
        Proc("victoria-metrics", [vm, f"-httpListenAddr=127.0.0.1:{vm_port}", f"-storageDataPath={tmp / 'vm'}",
                                  "-retentionPeriod=1", "-search.latencyOffset=1s", "-search.disableCache",
                                  "-loggerLevel=WARN"], tmp),
        Proc("alertmanager", [alertmanager, f"--config.file={tmp / 'alertmanager.yml'}",
                              f"--storage.path={tmp / 'am'}", f"--web.listen-address=127.0.0.1:{am_port}",
                              "--cluster.listen-address="], tmp),
    ]
    ranks = []
    try:
        _wait("VictoriaMetrics", lambda: requests.get(vm_url + "/health", timeout=1).ok, 60, procs)
        _wait("Alertmanager", lambda: requests.get(am_url + "/-/ready", timeout=1).ok, 60, procs)
        procs.append(Proc("prometheus-agent", [prometheus, "--enable-feature=agent",
                                               f"--config.file={tmp / 'prometheus.yml'}",
                                               f"--storage.agent.path={tmp / 'prom-agent'}",
                                               f"--web.listen-address=127.0.0.1:{prom_port}"], tmp))
        procs.append(Proc("vmalert", [vmalert, f"-rule={tmp / 'fleet.rules.yml'}", f"-datasource.url={vm_url}",
                                      f"-remoteWrite.url={vm_url}", f"-notifier.url={am_url}",
                                      f"-evaluationInterval={EVAL:g}s", "-remoteWrite.flushInterval=500ms",
                                      f"-httpListenAddr=127.0.0.1:{vmalert_port}", "-loggerLevel=WARN"], tmp))
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for r in range(RANKS):
            ranks.append(subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.fleet_rank", "--rank", str(r), "--world", str(RANKS),
                 "--run", RUN, "--job", JOB, "--sd-dir", str(sd), "--step-seconds", str(STEP),
                 "--flops-per-step", str(FLOPS), "--peak", str(PEAK), "--eval-seconds", str(EVAL_SECONDS)],
                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / f"rank{r}.log", "w")))
        yield {"vm": vm_url, "rx": rx, "procs": procs, "ranks": ranks, "tmp": tmp}
    finally:
        for p in ranks:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in ranks:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for pr in reversed(procs):
            pr.stop()
        rx.stop()


def test_32_ranks_job_mfu_stragglers_hangs_and_memory(stack):
    vm, rx, procs, ranks = stack["vm"], stack["rx"], stack["procs"], stack["ranks"]
    sel = f'job="{JOB}",run="{RUN}"'
    # 1. every rank arrives, with its labels
    _wait("32 ranks in VictoriaMetrics",
          lambda: len(_query(vm, f"count by (rank) (mfuwatch_steps_total{{{sel}}})")) == RANKS, 120, procs)
    # 2. job MFU (recorded by vmalert) = mean of the ranks' own MFU, once the window is full of steady steps
    time.sleep(WINDOW + 3 * SCRAPE)

    def mfu_pair():
        rec = _query(vm, f"job:mfuwatch_mfu:ratio{{{sel}}}")
        own = _query(vm, f"mfuwatch_mfu_ratio{{{sel}}}")
        return (float(rec[0]["value"][1]), [float(s["value"][1]) for s in own]) if rec and len(own) == RANKS else None

    recorded, own = _wait("job MFU recorded", mfu_pair, 60, procs)
    mean_own = sum(own) / len(own)
    assert mean_own == pytest.approx(FLOPS / STEP / PEAK, rel=0.05)  # the ranks really run 0.1 s steps
    assert recorded == pytest.approx(mean_own, rel=0.01)
    raw = _query(vm, f"sum by (job, run) (rate(mfuwatch_model_flops_total{{{sel}}}[{WINDOW:g}s])) / "
                     f"sum by (job, run) (mfuwatch_peak_flops_per_second{{{sel}}})")
    assert float(raw[0]["value"][1]) == pytest.approx(recorded, rel=0.01)  # the same query answers in VM
    goodput = float(_query(vm, f"job:mfuwatch_goodput:ratio{{{sel}}}")[0]["value"][1])
    assert goodput == pytest.approx(0.9, abs=0.03)  # 10% of every step is scripted input wait
    series = _query(vm, f'count by (rank) ({{__name__=~"mfuwatch_.*",{sel}}})')
    per_rank = sorted(int(s["value"][1]) for s in series)
    # 3. faults
    ranks[STRAGGLER].send_signal(signal.SIGUSR1)
    t_straggler = time.time()
    ranks[HUNG].send_signal(signal.SIGUSR2)
    t_hang = time.time()
    ranks[INPUT_BOUND].send_signal(signal.SIGWINCH)
    t_input = time.time()

    def firing(name, **labels):
        for req in rx.delivered:
            for a in req.json.get("alerts", []):
                if a["labels"].get("alertname") == name and a["status"] == "firing" and \
                        all(a["labels"].get(k) == v for k, v in labels.items()):
                    return a, req.at
        return None

    hang_budget = STALLED + 2 * SCRAPE + PIPELINE
    straggler_budget = WINDOW + STRAGGLER_FOR + 2 * SCRAPE + PIPELINE
    # the input-wait share (10% before, 50% after) crosses 3 x 10% once half of the window holds the new wait
    input_budget = WINDOW + INPUT_FOR + 2 * SCRAPE + PIPELINE
    hang, hang_at = _wait("TrainingStalled", lambda: firing("TrainingStalled", kind="fleet"), hang_budget + 30, procs)
    strag, strag_at = _wait("StragglerRank", lambda: firing("StragglerRank", kind="chronic"), straggler_budget + 30,
                            procs)
    inp, inp_at = _wait("InputBoundRank", lambda: firing("InputBoundRank"), input_budget + 30, procs)
    mono_now, wall_now = time.monotonic(), time.time()
    hang_delay = wall_now - (mono_now - hang_at) - t_hang
    strag_delay = wall_now - (mono_now - strag_at) - t_straggler
    input_delay = wall_now - (mono_now - inp_at) - t_input
    memory = {pr.name: _rss_bytes(pr.p.pid) for pr in procs}
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "fleet_scale.json").write_text(json.dumps({
        "ranks": RANKS, "series_per_rank": per_rank, "rss_bytes": memory, "scrape_interval_seconds": SCRAPE,
        "hang_to_notification_seconds": hang_delay, "straggler_to_notification_seconds": strag_delay,
        "hang_budget_seconds": hang_budget, "straggler_budget_seconds": straggler_budget,
        "input_bound_to_notification_seconds": input_delay, "input_bound_budget_seconds": input_budget,
        "job_mfu_recorded": recorded, "mean_rank_mfu": mean_own, "job_goodput": goodput}, indent=1))
    assert hang["labels"]["rank"] == str(HUNG) and hang["labels"]["host"] == f"sim-node-{HUNG // 8}"
    assert "stuck_in_data_loader" in hang["annotations"]["description"], hang["annotations"]
    assert strag["labels"]["rank"] == str(STRAGGLER) and strag["labels"]["host"] == f"sim-node-{STRAGGLER // 8}"
    assert inp["labels"]["rank"] == str(INPUT_BOUND) and inp["labels"]["host"] == f"sim-node-{INPUT_BOUND // 8}"
    assert "least-waiting rank waits" in inp["annotations"]["summary"], inp["annotations"]
    named = {}
    for req in rx.delivered:
        for a in req.json.get("alerts", []):
            named.setdefault(a["labels"].get("alertname"), set()).add(a["labels"]["rank"])
    # no other rank was named; the slow loader's step time did not change, so it is no StragglerRank
    assert named.get("StragglerRank") == {str(STRAGGLER)} and named.get("TrainingStalled") == {str(HUNG)}, named
    assert named.get("InputBoundRank") == {str(INPUT_BOUND)}, named
    assert hang_delay <= hang_budget, (hang_delay, hang_budget)
    assert strag_delay <= straggler_budget, (strag_delay, straggler_budget)
    assert input_delay <= input_budget, (input_delay, input_budget)
    assert per_rank and per_rank[-1] <= 110, per_rank  # the documented budget (docs/fleet.md)
    # 4. phases: no stall page inside an eval longer than the threshold, nor after one when the rank steps on
    ranks[IN_EVAL].send_signal(signal.SIGHUP)
    ranks[EVAL_THEN_STEP].send_signal(signal.SIGALRM)
    t_eval = time.time()
    # long enough for the stall alerts the phases must keep quiet to reach the receiver: inside the evals
    # (from t_eval + STALLED), and after the short one's end had the clock not restarted there
    time.sleep(max(0.0, t_eval + EVAL_SECONDS + STALLED + 2 * SCRAPE + PIPELINE - time.time()))
    in_eval = _query(vm, f'mfuwatch_phase_in_progress{{{sel},rank="{IN_EVAL}"}}')
    assert [float(s["value"][1]) for s in in_eval] == [1.0], in_eval  # the never-ending eval is open
    ended = _query(vm, f'mfuwatch_last_phase_end_timestamp_seconds{{{sel},rank="{EVAL_THEN_STEP}"}}')
    assert len(ended) == 1 and float(ended[0]["value"][1]) >= t_eval + EVAL_SECONDS - 1, ended
    stepped = _query(vm, f'increase(mfuwatch_steps_total{{{sel},rank="{EVAL_THEN_STEP}"}}[{STALLED:g}s])')
    assert stepped and float(stepped[0]["value"][1]) > 0, stepped  # it steps again after the eval
    stalled = {a["labels"]["rank"] for req in rx.delivered for a in req.json.get("alerts", [])
               if a["labels"].get("alertname") == "TrainingStalled" and a["status"] == "firing"}
    # ranks 27 and 29 made no step for > STALLED, inside their phase
    assert stalled == {str(HUNG)}, [(a["labels"]["rank"], a["annotations"].get("summary")) for req in rx.delivered
                                    for a in req.json.get("alerts", []) if a["labels"].get("alertname") ==
                                    "TrainingStalled"]
