"""The resume read (lost progress of the previous attempt) is bounded, validated and off the training thread
(issue #28): implausible records of the timeline's tail are ignored and counted, never trusted."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from mfuwatch.agent import Agent
from mfuwatch.agent.fleet import goodput as goodput_mod
from mfuwatch.agent.fleet.goodput import MAX_RECORD_BYTES, read_resume, steps_to_redo
from mfuwatch.agent.live.timeline import read_timeline


def _attempt(step_recs, ckpt=None, t0=1.7e9):
    recs = [{"kind": "attempt", "timestamp": t0}]
    for s, n in step_recs:
        recs.append({"kind": "step", "step": s, "steps": n, "step_time_seconds": 0.5, "timestamp": t0 + s * 0.5})
    if ckpt is not None:
        recs.append({"kind": "checkpoint", "phase": "save", "step": ckpt, "timestamp": t0 + ckpt * 0.5 + 0.1})
    return recs


def test_plausible_attempt_is_counted_as_before():
    recs = _attempt([(10, 10), (20, 10), (30, 10)], ckpt=20)
    ignored = [0]
    assert steps_to_redo(recs, ignored) == {"steps": 10.0, "seconds": 5.0, "last_step": 30.0,
                                            "checkpoint_step": 20.0}
    assert ignored == [0]


@pytest.mark.parametrize("bad", [
    {"step": float("inf")}, {"step": float("nan")}, {"step": 10 ** 15, "steps": 10 ** 15},
    {"step": 10 ** 15}, {"step": "40"}, {"step": True}, {"step": 40.5}, {"steps": 0},
    {"step_time_seconds": float("inf")}, {"step_time_seconds": -1.0}, {"step": 25},  # 25 < 30: goes back
    {"step": 10 ** 9, "steps": 10, "timestamp": 1.7e9 + 15.5},  # 10^9 steps in half a second
])
def test_an_implausible_step_record_is_ignored_and_counted(bad):
    good = _attempt([(10, 10), (20, 10), (30, 10)], ckpt=20)
    rec = {"kind": "step", "step": 40, "steps": 10, "step_time_seconds": 0.5, "timestamp": 1.7e9 + 20.0, **bad}
    ignored = [0]
    out = steps_to_redo(good + [rec], ignored)
    assert ignored == [1]
    assert out == steps_to_redo(good)  # as if the record were not there


def test_an_implausible_checkpoint_is_ignored():
    recs = _attempt([(10, 10), (20, 10)])
    ignored = [0]
    bad = [{"kind": "checkpoint", "step": float("inf")}, {"kind": "checkpoint", "step": -3},
           {"kind": "checkpoint", "step": 10 ** 13, "timestamp": 1.7e9 + 11}]
    out = steps_to_redo(recs + bad, ignored)
    assert ignored == [3] and out["steps"] == 20 and out["checkpoint_step"] == 0


def test_infinity_and_huge_claims_in_a_real_file(tmp_path):
    p = tmp_path / "tl.jsonl"
    lines = [json.dumps(r) for r in _attempt([(10, 10), (20, 10)], ckpt=10)]
    lines.insert(2, '{"kind":"step","step":Infinity,"steps":10,"step_time_seconds":0.5}')  # json.dumps can write it
    lines.insert(3, json.dumps({"kind": "step", "step": 10 ** 15, "steps": 10 ** 15, "step_time_seconds": 1e-3}))
    lines.append(json.dumps({"kind": "step", "pad": "x" * (MAX_RECORD_BYTES + 10)}))  # an oversized line
    p.write_text("\n".join(lines) + "\n")
    out = read_resume(p)
    assert out == {"steps": 10.0, "seconds": 5.0, "last_step": 20.0, "checkpoint_step": 10.0, "ignored": 3.0}


def test_only_a_bounded_tail_is_read(tmp_path, monkeypatch):
    p = tmp_path / "tl.jsonl"
    recs = _attempt([(10 * i, 10) for i in range(1, 2001)], ckpt=19990)
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    reads = []
    real_open = open

    class Spy:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def seek(self, *a):
            return self.fh.seek(*a)

        def read(self, n=-1):
            data = self.fh.read(n)
            reads.append(len(data))
            return data

    monkeypatch.setattr("builtins.open", lambda *a, **k: Spy(real_open(*a, **k)))
    out = read_resume(p, max_bytes=4096)
    monkeypatch.undo()
    assert sum(reads) <= 4096
    assert out["steps"] == 10 and out["last_step"] == 20000  # the tail holds the last attempt's end


def test_the_read_is_off_the_training_thread_and_the_attempt_record_waits_for_it(tmp_path, monkeypatch):
    tl = tmp_path / "tl.jsonl"
    tl.write_text("".join(json.dumps(r) + "\n" for r in _attempt([(10, 10), (20, 10)], ckpt=10)))
    gate = threading.Event()
    seen = {}
    real = goodput_mod.read_resume

    def slow_read(path, max_bytes=goodput_mod.TAIL_BYTES):
        seen["thread"] = threading.current_thread().name
        gate.wait(10)
        return real(path, max_bytes)

    monkeypatch.setattr(goodput_mod, "read_resume", slow_read)
    a = Agent(config=dict(run="resume", exporter=False, nvml=False, profile_every="off", alerts=False,
                          flops_per_step=1e9, timeline=str(tl), goodput_warmup_steps=0, progress=False))
    try:
        assert not a.fleet._resume_reader.done  # Agent() returned while the read still waits
        deadline = time.monotonic() + 5
        while "thread" not in seen and time.monotonic() < deadline:  # the reader thread may start late
            time.sleep(0.01)
        assert seen["thread"] == "mfuwatch-resume"
        gate.set()
        for _ in range(15):
            a.step(tokens=4)
    finally:
        gate.set()
        a.close()
    attempts = [r for r in read_timeline(tl) if r["kind"] == "attempt"]
    assert attempts[-1]["lost_steps"] == 10 and attempts[-1]["lost_ignored"] == 0
    kinds = [r["kind"] for r in read_timeline(tl)]
    last_attempt = len(kinds) - 1 - kinds[::-1].index("attempt")
    assert "step" not in kinds[len(_attempt([(10, 10), (20, 10)], ckpt=10)):last_attempt]  # attempt before steps
    lost = a.registry.get_sample_value("mfuwatch_goodput_seconds_total",
                                       {"run": "resume", "rank": "0", "bucket": "lost_progress"})
    assert lost is not None and lost > 0  # steps 1..10 re-did the lost progress


def test_ignored_records_are_counted_in_agent_errors_and_logged_in_one_line(tmp_path, caplog):
    tl = tmp_path / "tl.jsonl"
    recs = _attempt([(10, 10)]) + [{"kind": "step", "step": 10 ** 15, "steps": 10 ** 15, "step_time_seconds": 0.1}]
    lines = [json.dumps(r) for r in recs]
    # three records to ignore: the step number of 10**15 above, a non-finite step time, a garbled line
    lines.insert(-1, '{"kind": "step", "step": 11, "steps": 1, "step_time_seconds": Infinity}')
    lines.insert(-1, '{"kind": "step", "step": 12, "ste')
    tl.write_text("".join(line + "\n" for line in lines))
    with caplog.at_level(logging.DEBUG, logger="mfuwatch"):
        a = Agent(config=dict(run="resume2", exporter=False, nvml=False, profile_every="off", alerts=False,
                              flops_per_step=1e9, timeline=str(tl), progress=False))
        a.fleet._resume_reader.result(5.0)
        a.close()
    assert a.errors.get("resume") == 3  # one count per ignored record
    attempts = [json.loads(line) for line in tl.read_text().splitlines() if '"kind":"attempt"' in line]
    assert attempts[-1]["lost_steps"] == 10 and attempts[-1]["lost_ignored"] == 3
    # the documented single warning (docs/reliability.md), no "resume failed", no traceback
    resume = [r for r in caplog.records if "lost-progress" in r.getMessage() or "resume" in r.getMessage()]
    assert [(r.levelno, r.getMessage(), r.exc_info) for r in resume] == [(
        logging.WARNING, "mfuwatch: 3 record(s) of the timeline's tail ignored for the lost-progress figure "
        "(implausible step numbers, non-finite values, oversized or garbled lines); counted in "
        'mfuwatch_agent_errors_total{component="resume"}', None)]


def test_a_tail_inside_a_long_attempt_counts_only_the_steps_in_view(tmp_path):
    p = tmp_path / "tl.jsonl"
    recs = _attempt([(10 * i, 10) for i in range(1, 5001)])  # 50,000 steps, no checkpoint
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    whole = read_resume(p)
    assert whole["steps"] == 50000  # the attempt record in view: a restart from scratch loses them all
    tail = read_resume(p, max_bytes=2000)
    # not 50,000 from a cut tail: the steps of the records in view, each 0.5 s
    assert tail["last_step"] == 50000 and 0 < tail["steps"] < 300 and tail["checkpoint_step"] == 0
    assert tail["seconds"] == tail["steps"] * 0.5
