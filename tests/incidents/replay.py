"""Replay the incident corpus (``tests/incidents/scenarios/*.yaml``) through both alert paths.

One generator: :func:`simulate` plays a scenario's timeline second by second for every rank and feeds

* the in-process path: a real :class:`~mfuwatch.alerts.AlertEngine` per process, on a fake monotonic clock
  and a fake wall clock (which the scenario may step), sharing a real
  :class:`~mfuwatch.alerts.stall.StallClock` fed per step, with GPM samples averaged per report by the real
  :class:`~mfuwatch.agent.activity.ActivityAverager`; the engine's watchdog rules run every second, the
  others every ``evaluation_interval`` (15 s); reports come every ``report_steps`` steps and at least
  every 10 s while steps are pending, as the agent thread's;
* the Prometheus path: every 15 s, what the agent's exporter would serve — the real
  :class:`~mfuwatch.agent.live.exporter.MeasurementCollector`'s gauges (fed the same measurements) plus the
  counters the agent keeps (steps, tokens, FLOPs of timed steps, step seconds, goodput buckets, the
  step-time histogram's sum and count) — is written as ``promtool test rules`` input over the shipped rules
  (``mfuwatch alerts render-prometheus`` for the scenario's config, and the fleet rules); a target that is
  gone gets Prometheus's staleness marker at its first failed scrape.

Both paths are read the same way: the set of alerts firing at every 15 s check (promtool prints the
``ALERTS{alertstate="firing"}`` it finds, since each check expects none), minus those the default inhibition
rules mute, i.e. the pages. :func:`judge` compares them with the scenario's ``expect`` list (alert, ranks,
the window it must fire in and the window it must resolve in) and :func:`table` renders the result for
docs/reliability.md (``python -m tests.incidents.replay --write`` rewrites it there).

Scenario schema (durations as ``90s``/``5m``/``1h`` or seconds)::

    name: eval_30m_phase
    title: A 30-minute eval in agent.phase("eval")
    ranks: 2
    duration: 80m
    params: {step_time: 0.5, mfu: 0.42, bound: 0.5}   # defaults for every rank (see DEFAULTS)
    rules: {}                                          # alert-config rule overrides, both paths
    fleet: {}                                          # FleetRuleConfig overrides (the fleet rules)
    timeline:                                          # events, each for `ranks` (default all)
      - {at: 20m, kind: phase, name: eval, for: 30m}   # phase | hang | wait | set | stop | start | clock_step
    expect:
      - {alert: TrainingStalled, ranks: [0, 1], fires: [5m, 6m], resolves: [10m, 11m]}
    series:                                            # Prometheus-only checks of recorded series
      - {expr: "job:mfuwatch_mfu:ratio", at: 1m, value: 0.42}
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from mfuwatch.agent.activity import ActivityAverager
from mfuwatch.agent.live.exporter import MeasurementCollector
from mfuwatch.agent.fleet.goodput import BUCKETS
from mfuwatch.agent.device.nvml_device import CLOCK_EVENT_REASONS
from mfuwatch.agent.schema import CATEGORIES, GpuHealth, RunInfo, StepMeasurement, WindowMeasurement
from mfuwatch.alerts import AlertEngine, load_config, render_prometheus
from mfuwatch.alerts.fleet_rules import render_fleet
from mfuwatch.alerts.stall import StallClock
from mfuwatch.alerts.validation import format_duration, parse_duration

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCENARIOS = HERE / "scenarios"
DOC = REPO / "docs" / "reliability.md"
BEGIN, END = "<!-- incident-table:begin -->", "<!-- incident-table:end -->"

PROCESSES = 2  # promtool processes run at once
SCRAPE = 30  # seconds: scrape and rule evaluation interval of the Prometheus path, and the check interval
WALL0 = 1_800_000_000.0  # the fake wall clock's start (unix seconds)
PEAK = 1e15  # FLOP/s of one device
MAX_CLOCK = 1980e6  # Hz
REASONS = tuple(r[0] for r in CLOCK_EVENT_REASONS)
#: Alerts only the Prometheus path raises: they need every rank's series.
PROMETHEUS_ONLY = {"StragglerRank", "InputBoundRank", "GoodputLow"}

#: Per-rank defaults a scenario's ``params`` and ``set`` events override.
DEFAULTS: Dict[str, Any] = {
    "step_time": 0.5,  # seconds per optimizer step (boundary to boundary)
    "mfu": 0.42,
    "bound": 0.5,  # tensor active x SM clock / max SM clock while training
    "clock": MAX_CLOCK,  # SM clock (Hz)
    "input_wait": 0.02,  # share of training wall time between a step's end and the next forward
    "tokens_per_step": 16384,
    "idle_share": 0.05,  # the profiler window's idle share of wall time
    "memory_bound": 0.25,  # the profiler window's memory-bound share of busy time
    "throttle": [],  # active NVML clock-event reasons
    "window_every": 300,  # seconds of training between two profiler windows
    "report_steps": 4,  # the agent reports every report_every_steps steps ...
    "report_seconds": 10,  # ... and at least every 10 s while steps are pending
    "startup": 60,  # seconds from process start to the first step
    "lost_progress": 0,  # seconds of re-done steps after a (re)start
}


def _sec(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) else parse_duration(v, "scenario")


def load(path: Path) -> Dict[str, Any]:
    """One scenario file, durations parsed to seconds."""
    sc = yaml.safe_load(path.read_text(encoding="utf-8"))
    sc["duration"] = _sec(sc["duration"])
    sc.setdefault("params", {})
    sc.setdefault("rules", {})
    sc.setdefault("timeline", [])
    sc.setdefault("expect", [])
    sc.setdefault("series", [])
    for ev in sc["timeline"]:
        ev["at"] = _sec(ev["at"])
        if "for" in ev:
            ev["for"] = _sec(ev["for"])
    for e in sc["expect"]:
        e["fires"] = [_sec(x) for x in e["fires"]]
        e["resolves"] = None if e.get("resolves") is None else [_sec(x) for x in e["resolves"]]
    for s in sc["series"]:
        s["at"] = _sec(s["at"])
    return sc


def scenarios() -> List[Dict[str, Any]]:
    """Every scenario of the corpus, in file-name order."""
    return [load(p) for p in sorted(SCENARIOS.glob("*.yaml"))]


def alert_config(sc: Dict[str, Any]):
    """The alert config of a scenario: the shipped defaults, no notifier, the scenario's rule overrides."""
    return load_config({"notifiers": [], "rules": sc["rules"]})


# ------------------------------------------------------------------------------------------------ one rank
class _Process:
    """One training process of one rank: the agent's parts both paths read."""

    def __init__(self, rank: int, world: int, clocks: "_Clocks", cfg, started: float) -> None:
        self.rank = rank
        self.run_info = RunInfo(run="r", rank=rank, world_size=world, host=f"gpu-node-{rank}", device=f"cuda:{rank}",
                                gpu_name="NVIDIA H200", dtype="bf16", peak_flops_per_second=PEAK,
                                peak_source="datasheet", flops_source="analytic", job="train")
        self.stall = StallClock(clocks.mono)
        self.activity = ActivityAverager()
        self.collector = MeasurementCollector(self.run_info)
        self.collector.stall_seconds = self.stall.seconds
        self.events: List[Tuple[float, str, str]] = []  # (scenario seconds, alertname, firing|resolved)
        self.engine = AlertEngine(cfg, run_info=self.run_info, clock=clocks.wall, monotonic=clocks.mono,
                                  stall_clock=self.stall,
                                  on_event=lambda rec: self.events.append((clocks.t, rec["alertname"],
                                                                           rec["status"])))
        self.counters: Dict[str, float] = {"steps": 0.0, "tokens": 0.0, "model_flops": 0.0, "hardware_flops": 0.0,
                                           "step_seconds": 0.0, "hist_sum": 0.0, "hist_count": 0.0}
        self.goodput = {b: 0.0 for b in BUCKETS}
        self.started = started
        self.phase: Optional[Tuple[str, str]] = None  # (name, bucket)
        self.last_phase_end_wall = 0.0
        self.step_frac = 0.0
        self.pending = 0  # steps since the last report
        self.acc_start = clocks.mono()
        self.since_wall: Optional[float] = None  # wall end of the previous report
        self.last_step_end_wall: Optional[float] = None
        self.trained = 0.0  # seconds of training (profiler window cadence)
        self.windows = 0
        self.reports = 0


class _Clocks:
    def __init__(self) -> None:
        self.t = 0.0  # scenario seconds
        self.offset = 0.0  # wall clock steps so far

    def mono(self) -> float:
        return 1000.0 + self.t

    def wall(self) -> float:
        return WALL0 + self.t + self.offset


def simulate(sc: Dict[str, Any]) -> Tuple[Dict[Tuple[str, str, str], List[int]], Dict[Tuple[str, str, str], int],
                                           Dict[str, List[Optional[str]]]]:
    """Play ``sc``; returns (engine: key -> check times firing, engine: key -> firing episodes, promtool series).

    Keys are ``(alertname, rank, kind)``. Events (each for ``ranks``, default every rank):

    ``phase`` (``name``, ``bucket``, ``for``): an agent phase, GPU idle, no steps; ``hang`` (``for``): no step
    ends, the time stays in the step (productive bucket); ``wait`` (``for``): no step starts (input_wait
    bucket: an input stall, an eval outside a phase, a loop that ended with the agent left open); ``set``
    (parameters, optional ``for``): change a rank's parameters; ``stop`` (``how``: ``clean``/``sigterm`` =
    the agent closes, its exporter goes; ``agent_open`` = the loop ends, the agent and exporter stay);
    ``start`` (``startup``, ``lost_progress``): a new process; ``clock_step`` (``seconds``): the wall clock
    of every rank's host jumps.
    """
    cfg = alert_config(sc)
    ranks = int(sc.get("ranks", 1))
    clocks = _Clocks()
    duration = int(sc["duration"])
    base = {**DEFAULTS, **sc["params"]}
    params = [dict(base) for _ in range(ranks)]
    reverts: List[Tuple[float, int, dict]] = []
    modes: List[Tuple[str, float, dict]] = [("train", float("inf"), {}) for _ in range(ranks)]  # mode, until, ev
    procs: List[Optional[_Process]] = [None] * ranks
    dead_procs: List[_Process] = []
    timeline = sorted(sc["timeline"], key=lambda e: e["at"])
    starts_at_zero = not any(e["kind"] == "start" and e["at"] == 0 for e in timeline)
    if starts_at_zero:
        timeline = [{"at": 0.0, "kind": "start"}] + timeline
    startup_until = [0.0] * ranks
    lost_until = [0.0] * ranks
    engine_firing: Dict[Tuple[str, str, str], List[int]] = {}
    series: Dict[str, List[Optional[str]]] = {}
    n_scrapes = duration // SCRAPE + 1
    ev_i = 0
    seen: List[set] = [set() for _ in range(ranks)]  # engine alerts firing at some second since the last check

    def begin(r: int, ev: dict) -> None:
        p = procs[r]
        kind = ev["kind"]
        if kind == "start":
            procs[r] = _Process(r, ranks, clocks, cfg, clocks.t)
            startup_until[r] = clocks.t + _sec(ev.get("startup", params[r]["startup"]))
            lost_until[r] = startup_until[r] + _sec(ev.get("lost_progress", params[r]["lost_progress"]))
            modes[r] = ("train", float("inf"), {})
            return
        if p is None:
            return
        if kind == "stop":
            how = ev.get("how", "clean")
            if how == "agent_open":
                modes[r] = ("wait", float("inf"), ev)
                return
            p.engine.close(timeout=0.0)
            dead_procs.append(p)
            procs[r] = None
            return
        if kind == "set":
            changes = {k: v for k, v in ev.items() if k not in ("at", "kind", "ranks", "for")}
            if "for" in ev:
                reverts.append((clocks.t + ev["for"], r, {k: params[r][k] for k in changes}))
            params[r].update(changes)
            return
        until = clocks.t + ev.get("for", float("inf"))
        if kind == "phase":
            p.phase = (ev.get("name", "eval"), ev.get("bucket", "eval"))
            p.stall.pause()
        modes[r] = (kind, until, ev)

    def end_mode(r: int) -> None:
        p = procs[r]
        kind = modes[r][0]
        if p is not None and kind == "phase":
            p.phase = None
            p.last_phase_end_wall = clocks.wall()
            p.stall.resume()
        modes[r] = ("train", float("inf"), {})

    for second in range(duration + 1):
        clocks.t = float(second)
        while ev_i < len(timeline) and timeline[ev_i]["at"] <= clocks.t:
            ev = timeline[ev_i]
            ev_i += 1
            if ev["kind"] == "clock_step":
                clocks.offset += float(ev["seconds"])
                continue
            for r in ev.get("ranks", range(ranks)):
                begin(int(r), ev)
        for when, r, old in list(reverts):
            if when <= clocks.t:
                params[r].update(old)
                reverts.remove((when, r, old))
        for r in range(ranks):
            if modes[r][1] <= clocks.t:
                end_mode(r)
            p = procs[r]
            if p is None or second == 0:
                continue
            _tick(p, params[r], modes[r][0], clocks, startup_until[r], lost_until[r])
        for r in range(ranks):
            p = procs[r]
            if p is None:
                continue
            p.engine.evaluate(now=clocks.mono(), rules=p.engine._watch_rules)
            if second % int(cfg.evaluation_interval_seconds) == 0:
                p.engine.evaluate(now=clocks.mono(), rules=p.engine._eval_rules)
        if second % SCRAPE == 0:
            # the engine pages at any second: a check counts what fires now and what began firing since the
            # previous check (an episode shorter than the check interval is a page too)
            for r in range(ranks):
                p = procs[r]
                if p is not None:
                    seen[r] |= {name for name, st in p.engine._states.items() if st.state == "firing"}
                for q in [x for x in dead_procs + procs if x is not None and x.rank == r]:
                    seen[r] |= {name for t, name, status in q.events if status == "firing" and t > second - SCRAPE}
        if second % SCRAPE == 0:
            i = second // SCRAPE
            for r in range(ranks):
                p = procs[r]
                for key, value in (_scrape(p) if p is not None else {}).items():
                    series.setdefault(key, [None] * n_scrapes)[i] = value
            for key, values in series.items():  # a series gone since the last scrape: the staleness marker
                if i and values[i] is None and values[i - 1] not in (None, "stale"):
                    values[i] = "stale"
            for r in range(ranks):
                for name in sorted(seen[r]):
                    engine_firing.setdefault((name, str(r), ""), []).append(second)
                seen[r] = set()
    episodes: Dict[Tuple[str, str, str], int] = {}
    for p in dead_procs + [p for p in procs if p is not None]:
        for _, name, status in p.events:
            if status == "firing":
                key = (name, str(p.rank), "")
                episodes[key] = episodes.get(key, 0) + 1
    return engine_firing, episodes, series


def _tick(p: _Process, prm: dict, mode: str, clocks: _Clocks, startup_until: float, lost_until: float) -> None:
    """One second of one process (the scenario's second ``clocks.t`` just ended)."""
    t, wall = clocks.t, clocks.wall()
    training = mode == "train" and t > startup_until
    if mode == "train" and not training:
        bucket, steps = "startup", 0
    elif training:
        p.step_frac += 1.0 / float(prm["step_time"])
        steps = int(p.step_frac)
        p.step_frac -= steps
        bucket = "lost_progress" if t <= lost_until else "productive"
    elif mode == "phase":
        bucket, steps = p.phase[1], 0
    elif mode == "hang":
        bucket, steps = "productive", 0  # inside a step: forward began, no boundary yet
    else:  # wait
        bucket, steps = "input_wait", 0
    if training:
        w = float(prm["input_wait"])
        p.goodput[bucket] += 1.0 - w
        p.goodput["input_wait"] += w
    else:
        p.goodput[bucket] += 1.0
    # the GPU: tensor cores busy while training (bound = tensor x clock / max clock), idle otherwise
    clock = float(prm["clock"])
    tensor = float(prm["bound"]) * MAX_CLOCK / clock if training else 0.0
    g = GpuHealth(timestamp=wall, utilization=1.0 if training else 0.0, sm_clock_hertz=clock,
                  sm_clock_max_hertz=MAX_CLOCK, memory_used_bytes=70e9, memory_total_bytes=141e9,
                  clock_event_reasons={r: r in prm["throttle"] for r in REASONS},
                  ecc_errors={"corrected": 0, "uncorrected": 0}, xid_errors=0,
                  sm_active=0.9 if training else 0.0, tensor_active=tensor, dram_active=0.5 if training else 0.0)
    p.activity.add(g)
    p.engine.observe_gpu(g)
    p.collector.update(gpu=g)
    if steps:
        st = float(prm["step_time"])
        c = p.counters
        flops = float(prm["mfu"]) * PEAK * st
        c["steps"] += steps
        c["tokens"] += steps * prm["tokens_per_step"]
        c["model_flops"] += steps * flops
        c["hardware_flops"] += steps * flops
        c["step_seconds"] += steps * st
        c["hist_sum"] += steps * st
        c["hist_count"] += steps
        p.pending += steps
        p.stall.step(clocks.mono())
        p.last_step_end_wall = wall
        p.collector.last_step_wall = wall
        p.trained += 1.0
        if p.trained >= float(prm["window_every"]) * (p.windows + 1):
            p.windows += 1
            busy = 1.0 - float(prm["idle_share"])
            w = WindowMeasurement(step=int(c["steps"]), timestamp=wall, steps=5, wall_seconds=5 * st,
                                  busy_seconds=5 * st * busy,
                                  breakdown={"compute_bound": busy - float(prm["memory_bound"]) * busy,
                                             "memory_bound": float(prm["memory_bound"]) * busy,
                                             "communication": 0.0, "other": 0.0, "idle": float(prm["idle_share"])},
                                  memory_bound_share=float(prm["memory_bound"]))
            assert set(w.breakdown) == set(CATEGORIES)
            p.engine.observe_window(w)
            p.collector.update(window=w)
    # the agent thread's report: due at least every report_seconds while steps are pending (a late report of
    # steps that ended before a stall is the "catch-up report" of issue 24)
    if p.pending and (p.pending >= int(prm["report_steps"]) or
                      clocks.mono() - p.acc_start >= float(prm["report_seconds"])):
        st = float(prm["step_time"])
        end = p.last_step_end_wall
        act = p.activity.for_report(end, p.pending * st, p.since_wall, p.phase is not None, p.last_phase_end_wall)
        m = StepMeasurement(step=int(p.counters["steps"]), steps=p.pending, timestamp=end, step_time_seconds=st,
                            tokens=p.pending * prm["tokens_per_step"], tokens_per_second=prm["tokens_per_step"] / st,
                            model_flops=float(prm["mfu"]) * PEAK * st, hardware_flops=float(prm["mfu"]) * PEAK * st,
                            model_flops_per_second=float(prm["mfu"]) * PEAK, mfu=float(prm["mfu"]),
                            hfu=float(prm["mfu"]), tokens_per_step=prm["tokens_per_step"],
                            tensor_active=act and act.tensor_active, tensor_active_bound=act and act.tensor_active_bound,
                            sm_active=act and act.sm_active, dram_active=act and act.dram_active)
        p.engine.observe_step(m)
        p.collector.update(step=m)
        p.pending, p.acc_start, p.since_wall = 0, clocks.mono(), end
        p.reports += 1


def _labels(d: Dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(d.items())) + "}"


def _scrape(p: _Process) -> Dict[str, str]:
    """What the exporter of ``p`` serves now: selector -> value (promtool input syntax)."""
    base = {"job": "train", "run": "r", "rank": str(p.rank), "instance": f"node{p.rank}:9478"}
    out: Dict[str, str] = {}
    for fam in p.collector.collect():
        for s in fam.samples:
            labels = {**s.labels, **base}
            out[s.name + _labels(labels)] = repr(float(s.value))
    c = p.counters
    for name, v in (("mfuwatch_steps_total", c["steps"]), ("mfuwatch_tokens_total", c["tokens"]),
                    ("mfuwatch_model_flops_total", c["model_flops"]),
                    ("mfuwatch_hardware_flops_total", c["hardware_flops"]),
                    ("mfuwatch_step_seconds_total", c["step_seconds"]),
                    ("mfuwatch_step_duration_seconds_sum", c["hist_sum"]),
                    ("mfuwatch_step_duration_seconds_count", c["hist_count"])):
        out[name + _labels(base)] = repr(float(v))
    for b, v in p.goodput.items():
        out["mfuwatch_goodput_seconds_total" + _labels({**base, "bucket": b})] = repr(float(v))
    out["mfuwatch_phase_in_progress" + _labels(base)] = "1.0" if p.phase else "0.0"
    out["mfuwatch_last_phase_end_timestamp_seconds" + _labels(base)] = repr(p.last_phase_end_wall)
    return out


# ------------------------------------------------------------------------------------------------ Prometheus
_ALERTS = 'group by (alertname, run, rank, kind) (ALERTS{alertstate="firing"})'


def promtool_input(scs: Sequence[Dict[str, Any]], sims: Dict[str, Any],
                   rules_files: Dict[str, Tuple[str, str]]) -> Dict[str, dict]:
    """promtool test documents, one per rule set (file name -> document)."""
    docs: Dict[str, dict] = {}
    for sc in scs:
        series = sims[sc["name"]][2]
        checks = []
        for second in range(0, int(sc["duration"]) + 1, SCRAPE):
            expr = (f'label_replace(label_replace({_ALERTS}, "scenario", "{sc["name"]}", "", ""), "check", '
                    f'"alerts", "", "")')
            checks.append({"expr": expr, "eval_time": f"{second}s", "exp_samples": []})
        # proof that promtool loaded this scenario's series and ran its checks: every rank's run_info at 30 s
        checks.append({"expr": f'label_replace(label_replace(count(mfuwatch_run_info), "scenario", "{sc["name"]}", '
                               f'"", ""), "check", "sentinel", "", "")', "eval_time": f"{SCRAPE}s", "exp_samples": []})
        for i, s in enumerate(sc["series"]):
            expr = (f'label_replace(label_replace(round({s["expr"]}, 0.0001), "scenario", "{sc["name"]}", "", ""), '
                    f'"check", "series{i}", "", "")')
            checks.append({"expr": expr, "eval_time": f"{int(s['at'])}s", "exp_samples": []})
        test = {"name": sc["name"], "interval": f"{SCRAPE}s",
                "input_series": [{"series": k, "values": " ".join("_" if v is None else v for v in vals)}
                                 for k, vals in sorted(series.items())],
                "promql_expr_test": checks}
        files = rules_files[sc["name"]]
        docs.setdefault(files[0], {"rule_files": list(files), "evaluation_interval": f"{SCRAPE}s",
                                   "tests": []})["tests"].append(test)
    return docs


_BLOCK = re.compile(r'time: (\S+),\s*exp: .*?\n\s*got: (.*)')
_SAMPLE = re.compile(r'\{([^}]*)\} (\S+)')


def run_promtool(scs: Sequence[Dict[str, Any]], sims: Dict[str, Any], promtool: str) -> Dict[str, Any]:
    """Run every scenario through the shipped rules in one promtool invocation.

    Returns ``{scenario: {"firing": {key: [check seconds]}, "series": {index: value or None}}}``.
    """
    out: Dict[str, Any] = {sc["name"]: {"firing": {}, "series": {}} for sc in scs}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        rules_files: Dict[str, Tuple[str, str]] = {}
        by_cfg: Dict[str, Tuple[str, str]] = {}
        for sc in scs:
            key = json.dumps([sc["rules"], sc.get("fleet", {})], sort_keys=True)
            if key not in by_cfg:
                n = len(by_cfg)
                by_cfg[key] = (f"rules{n}.yml", f"fleet{n}.rules.yml")
                (d / by_cfg[key][0]).write_text(render_prometheus(alert_config(sc)), encoding="utf-8")
                (d / by_cfg[key][1]).write_text(render_fleet(**{k: _sec(v) for k, v in sc.get("fleet", {}).items()}),
                                                encoding="utf-8")
            rules_files[sc["name"]] = by_cfg[key]
        # the scenarios in PROCESSES promtool processes at once (CI has 2 cores), each over its share of the
        # test groups, longest first onto the least loaded process
        shares: List[List[Tuple[str, dict]]] = [[] for _ in range(PROCESSES)]
        load = [0.0] * PROCESSES
        for rules, doc in promtool_input(scs, sims, rules_files).items():
            for test in sorted(doc["tests"], key=lambda t: -len(t["promql_expr_test"]) * len(t["input_series"])):
                i = load.index(min(load))
                load[i] += len(test["promql_expr_test"]) * len(test["input_series"])
                shares[i].append((rules, {**doc, "tests": [test]}))
        procs = []
        for i, share in enumerate(shares):
            names = []
            for j, (rules, doc) in enumerate(share):
                name = f"test_{i}_{j}_{rules}"
                (d / name).write_text(yaml.safe_dump(doc, sort_keys=False, width=1 << 30), encoding="utf-8")
                names.append(name)
            if names:
                procs.append(subprocess.Popen([promtool, "test", "rules", *names], cwd=d, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))
        text = ""
        for proc in procs:
            try:
                printed, _ = proc.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                for p in procs:  # none of them may outlive the replay
                    p.kill()
                    p.wait()
                raise
            if proc.returncode != 0 and "FAILED:" not in printed:
                raise RuntimeError(f"promtool failed: {printed[-4000:]}")
            text += printed
    for m in _BLOCK.finditer(text):
        at = int(parse_duration(m.group(1), "promtool time"))
        for lab, value in _SAMPLE.findall(m.group(2)):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', lab))
            scen = out[labels.pop("scenario")]
            check = labels.pop("check")
            if check == "sentinel":
                scen["sentinel"] = float(value)
            elif check == "alerts":
                key = (labels["alertname"], labels.get("rank", ""), labels.get("kind", ""))
                scen["firing"].setdefault(key, []).append(at)
            else:
                scen["series"][int(check[len("series"):])] = float(value)
    for sc in scs:
        if out[sc["name"]].get("sentinel") != float(sc.get("ranks", 1)):
            raise RuntimeError(f"promtool did not run scenario {sc['name']} (its series did not load): "
                               f"{text[-4000:]}")
    return out


# ------------------------------------------------------------------------------------------------ judging
def _pages(firing: Dict[Tuple[str, str, str], List[int]], cfg) -> Dict[Tuple[str, str, str], List[int]]:
    """Firing alerts minus those the config's inhibition rules mute (the default: a stall mutes MfuLow, ...)."""
    by_time: Dict[int, List[Tuple[str, str, str]]] = {}
    for key, times in firing.items():
        for t in times:
            by_time.setdefault(t, []).append(key)
    out: Dict[Tuple[str, str, str], List[int]] = {}
    for t, keys in by_time.items():
        labels = [{"alertname": a, "run": "r", "rank": r, "kind": k} for a, r, k in keys]
        for key, lab in zip(keys, labels):
            if not any(i.inhibits(lab, labels) for i in cfg.inhibit_rules):
                out.setdefault(key, []).append(t)
    return {k: sorted(v) for k, v in out.items()}


def _expected_keys(e: dict, path: str) -> List[Tuple[str, str, str]]:
    ranks = [str(r) for r in e.get("ranks", [""])]
    paths = e.get("paths", ["prometheus"] if e["alert"] in PROMETHEUS_ONLY or e.get("kind") else
                  ["engine", "prometheus"])
    if path not in paths:
        return []
    keys = [(e["alert"], r, e.get("kind", "")) for r in ranks]
    if path == "prometheus" and e["alert"] == "TrainingStalled" and not e.get("kind"):
        keys += [(e["alert"], r, "fleet") for r in ranks]  # the fleet rule pages the same stall
    return keys


def _episodes(times: List[int]) -> List[Tuple[int, int]]:
    """Check times firing -> [(first, last)] runs of consecutive checks."""
    runs: List[Tuple[int, int]] = []
    for t in times:
        if runs and t - runs[-1][1] <= SCRAPE:
            runs[-1] = (runs[-1][0], t)
        else:
            runs.append((t, t))
    return runs


def judge(sc: Dict[str, Any], pages: Dict[Tuple[str, str, str], List[int]], path: str,
          engine_episodes: Optional[Dict[Tuple[str, str, str], int]] = None) -> Dict[Tuple[str, str, str], List[str]]:
    """Compare one path's pages with the scenario's expectations: key -> problems (empty: as expected).

    An expected page must fire inside ``fires`` (not before its start, by its end), stay firing, and be gone
    inside ``resolves`` (``None``: still firing at the scenario's end); once, as one episode. Any other page
    is a false page.
    """
    problems: Dict[Tuple[str, str, str], List[str]] = {}
    end = int(sc["duration"])
    expected: Dict[Tuple[str, str, str], dict] = {}
    for e in sc["expect"]:
        for key in _expected_keys(e, path):
            expected[key] = e
    for key in set(pages) | set(expected):
        got = pages.get(key, [])
        runs = _episodes(got)
        e = expected.get(key)
        msgs: List[str] = []
        if e is None:
            msgs.append("false page " + ", ".join(f"{_fmt(a)}-{_fmt(b + SCRAPE)}" for a, b in runs))
        elif not runs:
            msgs.append("missed")
        else:
            lo, hi = e["fires"]
            if runs[0][0] < lo:
                msgs.append(f"fired early at {_fmt(runs[0][0])}")
            if runs[0][0] > hi:
                msgs.append(f"fired late at {_fmt(runs[0][0])}")
            if len(runs) > 1:
                msgs.append(f"{len(runs)} episodes: " + ", ".join(f"{_fmt(a)}-{_fmt(b + SCRAPE)}" for a, b in runs))
            gone = runs[-1][1] + SCRAPE
            if e["resolves"] is None:
                if gone <= end:
                    msgs.append(f"resolved at {_fmt(gone)} (expected to fire to the end)")
            else:
                rlo, rhi = e["resolves"]
                if gone < rlo:
                    msgs.append(f"resolved early at {_fmt(gone)}")
                if gone > rhi:
                    msgs.append(f"resolved late at {_fmt(gone)}")
            if engine_episodes is not None and engine_episodes.get(key, 0) > 1:
                msgs.append(f"{engine_episodes[key]} firing transitions")
        problems[key] = msgs
    return problems


def _fmt(seconds: float) -> str:
    return format_duration(seconds) if seconds else "0s"


def replay_all(promtool: str, scs: Optional[List[Dict[str, Any]]] = None) -> List[dict]:
    """Both paths over every scenario: one row per (scenario, alert key) with the expectation and each path's
    problems and episodes."""
    scs = scenarios() if scs is None else scs
    sims = {sc["name"]: simulate(sc) for sc in scs}
    prom = run_promtool(scs, sims, promtool)
    rows = []
    for sc in scs:
        cfg = alert_config(sc)
        eng_pages = _pages(sims[sc["name"]][0], cfg)
        prom_pages = _pages(prom[sc["name"]]["firing"], cfg)
        got = {"engine": (eng_pages, judge(sc, eng_pages, "engine", sims[sc["name"]][1])),
               "prometheus": (prom_pages, judge(sc, prom_pages, "prometheus"))}
        keys = sorted(set(got["engine"][1]) | set(got["prometheus"][1]) |
                      {k for e in sc["expect"] for p in ("engine", "prometheus") for k in _expected_keys(e, p)})
        for key in keys:
            e = next((e for e in sc["expect"] if key in _expected_keys(e, "engine") + _expected_keys(e, "prometheus")),
                     None)
            row = {"scenario": sc["name"], "title": sc.get("title", sc["name"]), "key": key, "expect": e, "paths": {}}
            for path in ("engine", "prometheus"):
                pages, problems = got[path]
                if path == "engine" and (key[2] or key[0] in PROMETHEUS_ONLY):
                    row["paths"][path] = {"na": "needs every rank's series"}
                    continue
                row["paths"][path] = {"problems": problems.get(key, []), "runs": _episodes(pages.get(key, []))}
            rows.append(row)
        if not keys:
            rows.append({"scenario": sc["name"], "title": sc.get("title", sc["name"]), "key": None, "expect": None,
                         "paths": {p: {"problems": [], "runs": []} for p in ("engine", "prometheus")}})
        for i, s in enumerate(sc["series"]):
            v = prom[sc["name"]]["series"].get(i)
            want = s.get("value")
            ok = (v is None) if want is None else (v is not None and abs(v - want) <= s.get("tolerance", 0.001))
            rows.append({"scenario": sc["name"], "title": sc.get("title", sc["name"]), "series": s, "value": v,
                         "ok": ok})
    return rows


def failures(rows: List[dict]) -> List[str]:
    """Every row that is not as expected, one line each."""
    out = []
    for row in rows:
        if "series" in row:
            if not row["ok"]:
                out.append(f"{row['scenario']}: {row['series']['expr']} at {_fmt(row['series']['at'])}: got "
                           f"{row['value']}, expected {row['series'].get('value')}")
            continue
        for path, r in row["paths"].items():
            for msg in r.get("problems", []):
                out.append(f"{row['scenario']} {path} {_key(row['key'])}: {msg}")
    return out


def _key(key: Optional[Tuple[str, str, str]]) -> str:
    if key is None:
        return "-"
    name, rank, kind = key
    return name + (f"{{kind={kind}}}" if kind else "") + (f" rank {rank}" if rank else "")


def _cell(r: dict) -> str:
    if "na" in r:
        return f"n/a: {r['na']}"
    runs = "; ".join(f"{_fmt(a)} → {_fmt(b + SCRAPE)}" for a, b in r["runs"]) or "no page"
    return runs + ("" if not r["problems"] else " **(" + "; ".join(r["problems"]) + ")**")


def table(rows: List[dict]) -> str:
    """The Markdown table of docs/reliability.md (scenario × alert, expected and got per path)."""
    lines = ["| scenario | alert | expected | in-process engine | Prometheus rules |", "|---|---|---|---|---|"]
    for row in rows:
        if "series" in row:
            s = row["series"]
            want = "no series" if s.get("value") is None else f"{s['value']:g}"
            got = "no series" if row["value"] is None else f"{row['value']:g}"
            lines.append(f"| {row['scenario']} | `{s['expr']}` at {_fmt(s['at'])} | {want} | n/a: a job series "
                         f"(Prometheus only) | {got}{'' if row['ok'] else ' **(wrong)**'} |")
            continue
        e = row["expect"]
        if row["key"] is None:
            lines.append(f"| {row['scenario']} | any | no page | no page | no page |")
            continue
        if e is None:
            want = "no page"
        else:
            want = f"fires {_fmt(e['fires'][0])}–{_fmt(e['fires'][1])}, " + (
                "still firing at the end" if e["resolves"] is None else
                f"resolves {_fmt(e['resolves'][0])}–{_fmt(e['resolves'][1])}")
            if e.get("paths") and len(e["paths"]) == 1 and e["alert"] not in PROMETHEUS_ONLY:
                other = "Prometheus" if e["paths"] == ["engine"] else "the engine"
                want += f" on the {'engine' if e['paths'] == ['engine'] else 'Prometheus'} path only, no page " \
                        f"from {other}"
            if e.get("note"):
                want += f" ({e['note']})"
        lines.append(f"| {row['scenario']} | {_key(row['key'])} | {want} | {_cell(row['paths']['engine'])} | "
                     f"{_cell(row['paths']['prometheus'])} |")
    titles = []
    seen = set()
    for row in rows:
        if row["scenario"] not in seen:
            seen.add(row["scenario"])
            titles.append(f"- `{row['scenario']}`: {row['title']}")
    return "\n".join(titles) + "\n\n" + "\n".join(lines) + "\n"


def doc_section(text: str) -> str:
    """The generated part of docs/reliability.md (between the markers)."""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def write_doc(rows: List[dict]) -> None:
    """Replace the generated table in docs/reliability.md."""
    text = DOC.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    DOC.write_text(head + BEGIN + "\n" + table(rows) + END + tail, encoding="utf-8")


def main(argv: Any = None) -> int:
    """``python -m tests.incidents.replay [--write]``: print (or write into docs/reliability.md) the table."""
    import shutil

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the table in docs/reliability.md")
    ap.add_argument("--promtool", default=shutil.which("promtool") or "promtool")
    a = ap.parse_args(argv)
    rows = replay_all(a.promtool)
    if a.write:
        write_doc(rows)
    print(table(rows))
    bad = failures(rows)
    for line in bad:
        print("NOT AS EXPECTED:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
