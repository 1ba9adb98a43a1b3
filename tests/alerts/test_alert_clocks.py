"""Monotonic time for every duration of the engine, wall time only for timestamps; one stall, one page;
resolved texts quote the value that resolved them (issue 24).

The engine runs on two fake clocks: ``mono`` (what ``for``, cool-down, repeat and the stall are timed on)
and ``wall`` (what records are stamped with), stepped independently as NTP or ``date`` would step the
system clock of a training host.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from mfuwatch.agent.schema import StepMeasurement
from mfuwatch.alerts import AlertEngine
from mfuwatch.alerts.stall import StallClock
from tests.helpers.capture_notifier import Capture


class Clocks:
    def __init__(self):
        self.mono_t, self.wall_t = 5000.0, 1_800_000_000.0

    def mono(self):
        return self.mono_t

    def wall(self):
        return self.wall_t

    def advance(self, s):
        self.mono_t += s
        self.wall_t += s


def step(mfu=0.5, i=1):
    return StepMeasurement(step=i, steps=1, timestamp=0.0, step_time_seconds=1.0, tokens=1, tokens_per_second=1.0,
                           model_flops=1.0, hardware_flops=1.0, model_flops_per_second=1.0, mfu=mfu)


STALL = {"use_default_rules": False, "inhibit_rules": [],
         "rules": {"TrainingStalled": {"expr": "seconds_since_last_step", "op": ">", "threshold": 3, "for": "0s",
                                       "severity": "critical", "cooldown": "5m",
                                       "annotations": {"summary": "no step for {value:duration}"}}}}
MFU_LOW = {"use_default_rules": False, "inhibit_rules": [], "repeat_interval": "4h",
           "rules": {"MfuLow": {"expr": "mfu", "op": "<", "threshold": 0.25, "for": "10m", "cooldown": "30m",
                                "severity": "warning", "annotations": {
                                    "summary": "MFU is {value:pct}, below {threshold:pct} for {for}"}}}}


def build(cfg, run_info, clocks, stall=None):
    events = []
    e = AlertEngine.from_config(cfg, run_info=run_info, registry=CollectorRegistry(), on_event=events.append,
                                clock=clocks.wall, monotonic=clocks.mono, stall_clock=stall)
    cap = Capture()
    e.workers = [cap]
    return e, cap, events


def test_a_forward_wall_clock_step_during_training_does_not_page(run_info):
    c = Clocks()
    stall = StallClock(c.mono)
    e, cap, events = build(STALL, run_info, c, stall)
    for _ in range(20):  # a step per second
        stall.step()
        e.evaluate()
        c.advance(1.0)
    c.wall_t += 600.0  # NTP steps the clock forward by 10 minutes
    for _ in range(20):
        stall.step()
        e.evaluate()
        c.advance(1.0)
    assert events == [] and cap.sent == []


def test_a_backward_wall_clock_step_during_a_real_stall_still_pages_on_time(run_info):
    c = Clocks()
    stall = StallClock(c.mono)
    e, cap, events = build(STALL, run_info, c, stall)
    stall.step()
    fired_at = None
    for second in range(1, 11):  # a 10 s stall, threshold 3 s; the clock steps back 600 s at second 2
        c.advance(1.0)
        if second == 2:
            c.wall_t -= 600.0
        e.evaluate()
        if fired_at is None and e.state("TrainingStalled") == "firing":
            fired_at = second
    assert fired_at == 4  # 4 s > 3 s on the monotonic clock
    assert [r["status"] for r in events] == ["firing"]
    assert events[0]["timestamp"] == 1_800_000_000.0 + 4 - 600.0  # stamped with the (stepped) wall clock


def test_a_late_report_of_older_steps_does_not_restart_the_stall_clock(run_info):
    c = Clocks()
    stall = StallClock(c.mono)
    e, cap, events = build(STALL, run_info, c, stall)
    stall.step()
    e.observe_step(step())
    for second in range(1, 26):  # a 25 s stall; the agent thread's catch-up report of older steps at 10 s
        c.advance(1.0)
        if second == 10:
            e.observe_step(step(i=2))
        e.evaluate()
    assert [r["status"] for r in events] == ["firing"], events  # one stall, one page (not fired/resolved/fired)
    assert e.store.value("seconds_since_last_step", {}, c.mono()) == 25.0


def test_an_engine_without_a_step_feed_times_the_stall_from_reports(run_info):
    c = Clocks()
    e, cap, events = build(STALL, run_info, c)  # no shared stall clock: reports are the only progress
    e.observe_step(step())
    c.advance(2.0)
    assert e.store.value("seconds_since_last_step", {}, c.mono()) == 2.0
    e.observe_step(step(i=2))
    assert e.store.value("seconds_since_last_step", {}, c.mono()) == 0.0


def test_for_cooldown_and_repeat_ignore_wall_clock_steps(run_info):
    c = Clocks()
    e, cap, events = build(MFU_LOW, run_info, c)
    e.observe_step(step(0.1))
    e.evaluate()
    c.advance(300.0)
    c.wall_t += 3600.0  # an hour forward on the wall clock: `for: 10m` has not passed
    e.evaluate()
    assert e.state("MfuLow") == "pending"
    c.advance(300.0)
    e.evaluate()
    assert e.state("MfuLow") == "firing" and len(cap.sent) == 1
    c.wall_t += 5 * 3600.0  # five hours forward: the 4h repeat is not due
    c.advance(60.0)
    e.evaluate()
    assert len(cap.sent) == 1
    e.observe_step(step(0.4))  # resolved ...
    e.evaluate()
    c.wall_t += 7200.0  # two hours forward: the 30m cool-down still counts from the resolve
    e.observe_step(step(0.1))
    e.evaluate()
    c.advance(601.0)
    e.evaluate()
    assert e.state("MfuLow") == "firing"  # fires again 10 min after the resolve: held back by the cool-down
    assert [(a.name, a.status) for n in cap.sent for a in n.alerts] == [("MfuLow", "firing"), ("MfuLow", "resolved")]


def _firing_mfu_low(run_info, mfu):
    """An engine whose MfuLow fires at ``mfu`` (10 min of it), and its clocks, capture and events."""
    c = Clocks()
    e, cap, events = build(MFU_LOW, run_info, c)
    e.observe_step(step(mfu))
    e.evaluate()
    c.advance(601.0)
    e.evaluate()
    assert e.state("MfuLow") == "firing"
    return c, e, cap, events


def test_the_resolved_text_quotes_the_resolving_value(run_info):
    c, e, cap, events = _firing_mfu_low(run_info, 0.1748)
    assert events[-1]["summary"] == "MFU is 17.48%, below 25% for 10m"
    e.observe_step(step(0.3125))
    c.advance(15.0)
    e.evaluate()
    rec = events[-1]
    assert rec["status"] == "resolved"
    assert rec["summary"] == "Resolved: MfuLow on run run-a rank 0: now 31.25%; it fires at < 25% for 10m"
    assert rec["annotations"]["resolved_value"] == "31.25%"
    assert rec["annotations"]["firing_summary"] == "MFU is 17.48%, below 25% for 10m"
    resolved = [a for n in cap.sent for a in n.alerts if a.status == "resolved"][0]
    assert resolved.value == 0.3125 and "31.25%" in resolved.annotations["summary"]


def test_a_resolve_because_the_data_ended_says_so(run_info):
    c, e, cap, events = _firing_mfu_low(run_info, 0.1)
    e.store.step = None  # the measurement is gone (no peak any more)
    c.advance(15.0)
    e.evaluate()
    assert events[-1]["status"] == "resolved" and "no data any more" in events[-1]["summary"]


def test_a_resolve_at_close_says_why_not_the_firing_text(run_info):
    # fresh-user pass (issue 24): a SIGTERM during a stall sent a resolved webhook whose summary still read
    # "Training stalled: no optimizer step for 6.006s" -- the firing text, which on-call reads as still stalled
    c, e, cap, events = _firing_mfu_low(run_info, 0.1748)
    e.close(timeout=0.0, reason="run preempted (SIGTERM)")
    rec = events[-1]
    assert rec["status"] == "resolved" and rec["reason"] == "run preempted (SIGTERM)"
    assert rec["summary"] == ("Resolved: MfuLow on run run-a rank 0: run preempted (SIGTERM), last value 17.48%; "
                              "it fires at < 25% for 10m")
    assert rec["annotations"]["firing_summary"] == "MFU is 17.48%, below 25% for 10m"
    assert rec["annotations"]["resolved_reason"] == "run preempted (SIGTERM)"
    assert rec["annotations"]["resolved_value"] == ""  # no value resolved it: the run did
    resolved = [a for n in cap.sent for a in n.alerts if a.status == "resolved"]
    assert [a.annotations["summary"] for a in resolved] == [rec["summary"]]
