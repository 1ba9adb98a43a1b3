"""A firing TrainingStalled says where the training thread waits: hang reports, the stall probe, trimming, notifiers.

The engine is driven with a fake clock and ``evaluate()``; the hang reports are the plain mappings the
agent hands over (``observe_hang``), so nothing here imports the agent's watchdog. The end-to-end check
(a real training thread stuck in a known function, real notifiers) is in tests/agent/test_watchdog.py.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from mfuwatch.agent.schema import StepMeasurement
from mfuwatch.alerts import AlertEngine
from mfuwatch.alerts.notifiers.console import alert_lines
from mfuwatch.alerts.notifiers.slack import alert_blocks
from mfuwatch.alerts.signals import HANG_FRAME_CHARS, HANG_FRAMES, hang_context
from tests.helpers.capture_notifier import Capture

STALL = {"inhibit_rules": [], "notifiers": [], "rules": {"TrainingStalled": {"threshold": 60, "for": "0s"}}}
#: 12 frames, outermost first, as the agent's watchdog writes them
STACK = [f"/job/train.py:{10 + i} in level_{i}" for i in range(11)] + ["/usr/lib/python3/queue.py:180 in get"]


def step(i=1):
    return StepMeasurement(step=i, steps=1, timestamp=0.0, step_time_seconds=1.0, tokens=1, tokens_per_second=1.0,
                           model_flops=1.0, hardware_flops=1.0, model_flops_per_second=1.0, mfu=0.5)


def _engine(run_info, clock):
    errors = []
    e = AlertEngine.from_config(STALL, run_info=run_info, registry=CollectorRegistry(), clock=clock,
                                on_error=lambda c, exc: errors.append(exc))
    cap = Capture()
    e.workers = [cap]
    e.notifying = True
    return e, cap, errors


def _fired(cap):
    return [a for n in cap.sent for a in n.alerts if a.name == "TrainingStalled" and a.status == "firing"]


def test_hang_context_keeps_the_innermost_frames_innermost_first_and_cuts_long_ones():
    long_frame = "/" + "d" * 300 + "/loader.py:7 in next_batch"
    ctx = hang_context({"where": long_frame, "stack": STACK[:-1] + [long_frame], "last_collective": "",
                        "step": "41", "elapsed_seconds": 75})
    assert HANG_FRAMES == 8 and HANG_FRAME_CHARS == 160
    assert len(ctx["frames"]) == 8
    assert ctx["frames"][1:] == [f"/job/train.py:{10 + i} in level_{i}" for i in (10, 9, 8, 7, 6, 5, 4)]
    assert len(ctx["where"]) == 160 and ctx["where"].startswith("…") and ctx["where"].endswith(
        "/loader.py:7 in next_batch")
    assert ctx["frames"][0] == ctx["where"]
    assert ctx["last_collective"] is None and ctx["step"] == 41 and ctx["elapsed_seconds"] == 75.0


def test_the_hang_report_goes_into_the_annotations_and_the_notifiers(run_info, clock):
    e, cap, _ = _engine(run_info, clock)
    e.observe_step(step())
    e.observe_hang({"where": STACK[-1], "stack": STACK, "last_collective": "nccl:all_reduce seq 812 started",
                    "step": 1, "elapsed_seconds": 61.0})
    clock.advance(61)
    e.evaluate()
    (a,) = _fired(cap)
    assert a.annotations["waiting_at"] == ("/usr/lib/python3/queue.py:180 in get "
                                           "(last collective: nccl:all_reduce seq 812 started)")
    assert a.annotations["stack"].splitlines() == [STACK[-1]] + [f"/job/train.py:{10 + i} in level_{i}"
                                                                for i in (10, 9, 8, 7, 6, 5, 4)]
    lines = alert_lines(a)
    assert "  waiting at: " + a.annotations["waiting_at"] in lines
    assert "    /job/train.py:20 in level_10" in lines and "    /job/train.py:13 in level_3" not in lines
    text = str(alert_blocks(a))
    assert "Training thread waits at" in text and "queue.py:180 in get" in text and "level_4" in text


def test_without_a_hang_report_the_probe_is_asked_once_per_firing_episode(run_info, clock):
    e, cap, _ = _engine(run_info, clock)
    calls = []

    def probe():
        calls.append(clock())
        return {"where": "/job/train.py:5 in wait_for_data", "stack": ["/job/train.py:5 in wait_for_data"]}

    e.stall_probe = probe
    e.observe_step(step())
    clock.advance(61)
    e.evaluate()
    clock.advance(5)
    e.evaluate()  # still firing: the stack taken when it fired stands
    assert len(calls) == 1
    assert _fired(cap)[0].annotations["waiting_at"] == "/job/train.py:5 in wait_for_data"
    # a hang report arriving later replaces the probe's stack at the next evaluation
    e.observe_hang({"where": "/job/train.py:9 in all_reduce_grads", "stack": ["/job/train.py:9 in all_reduce_grads"]})
    e.evaluate()
    assert e._states["TrainingStalled"].annotations["waiting_at"] == "/job/train.py:9 in all_reduce_grads"
    # the step ends: the hang is forgotten, the alert resolves; the next stall asks the probe again
    e.observe_hang(None)
    e.observe_step(step(2))
    e.evaluate()
    assert e.state("TrainingStalled") == "inactive"
    clock.advance(61)
    e.evaluate()
    assert len(calls) == 2


def test_a_failing_probe_is_counted_and_the_alert_still_fires(run_info, clock):
    e, cap, errors = _engine(run_info, clock)

    def probe():
        raise RuntimeError("no frames")

    e.stall_probe = probe
    e.observe_step(step())
    clock.advance(61)
    e.evaluate()
    (a,) = _fired(cap)
    assert "waiting_at" not in a.annotations and "hang" not in a.context
    assert len(errors) == 1 and e.errors == 1
    assert alert_lines(a)[0].startswith("[mfuwatch] FIRING TrainingStalled")


def test_a_malformed_hang_report_is_counted_not_stored(run_info, clock):
    e, cap, errors = _engine(run_info, clock)
    e.observe_hang({"where": "x", "stack": [], "step": "not a number"})
    assert e.store.latest_hang() is None and e.errors == 1 and len(errors) == 1
