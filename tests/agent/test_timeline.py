"""Timeline: JSONL records round-trip; NaN becomes null; a torn last line is tolerated."""

import json
import math

import pytest

from mfuwatch.agent.schema import StepMeasurement, to_record
from mfuwatch.agent.live.timeline import Timeline, read_timeline


def test_round_trip_and_nan(tmp_path):
    p = tmp_path / "t.jsonl"
    tl = Timeline(p)
    m = StepMeasurement(step=10, steps=10, timestamp=1.5, step_time_seconds=0.2, tokens=100, tokens_per_second=500.0,
                        model_flops=1e9, hardware_flops=1e9, model_flops_per_second=5e9, mfu=None, loss=math.nan)
    tl.write(to_record("step", m))
    tl.close()
    (r,) = list(read_timeline(p))
    assert r["kind"] == "step" and r["tokens"] == 100 and r["mfu"] is None and r["loss"] is None


def test_torn_last_line_skipped_but_middle_garbage_fails(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"kind":"run"}\n{"kind":"st')
    assert [r["kind"] for r in read_timeline(p)] == ["run"]
    p.write_text('{"kind":"run"}\nnot json\n{"kind":"step"}\n')
    with pytest.raises(ValueError, match=":2:"):
        list(read_timeline(p))


def test_appending_to_a_cut_file_ends_the_cut_line_first(tmp_path):
    # Issue #28: a job SIGKILLed mid-write leaves its last line cut; the restarted job's Timeline ended it with
    # a newline before its run record, so the cut line stays one bad line and every new record is whole.
    p = tmp_path / "t.jsonl"
    tl = Timeline(p)
    for i in range(1, 4):
        tl.write({"kind": "step", "step": 10 * i, "timestamp": float(i)})
    tl.close()
    whole = p.read_bytes()
    assert whole.count(b"\n") == 3 and whole.endswith(b"\n")
    p.write_bytes(whole[:-20])  # what `head -c -20` of a killed job's file leaves
    tl = Timeline(p)
    tl.write({"kind": "run", "run": "again", "rank": 0})
    tl.write({"kind": "step", "step": 40, "timestamp": 4.0})
    tl.close()
    lines = p.read_bytes().split(b"\n")
    assert lines[:2] == whole.split(b"\n")[:2] and lines[2] == whole.split(b"\n")[2][:-19]  # cut, kept as it was
    assert [json.loads(x) for x in lines[3:5]] == [{"kind": "run", "run": "again", "rank": 0},
                                                   {"kind": "step", "step": 40, "timestamp": 4.0}]
    assert lines[5:] == [b""] and len(lines) == 6
    # a whole file (and an empty one) gets no extra newline: appending again adds exactly its records
    before = p.read_bytes()
    tl = Timeline(p)
    tl.write({"kind": "step", "step": 50, "timestamp": 5.0})
    tl.close()
    assert p.read_bytes() == before + b'{"kind":"step","step":50,"timestamp":5.0}\n'
    e = tmp_path / "e.jsonl"
    e.touch()
    Timeline(e).close()
    assert e.read_bytes() == b""


def test_none_path_is_noop(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tl = Timeline(None)
    tl.write({"kind": "step"})
    tl.close()
    assert tl.path is None and list(tmp_path.iterdir()) == []  # nothing written anywhere


# ---- order: records in timestamp order, one run record first


class FakeMonotonic:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _kinds(p):
    return [(r["kind"], r.get("timestamp")) for r in read_timeline(p)]


def test_the_run_record_goes_first_and_holds_what_came_before_it(tmp_path):
    p = tmp_path / "t.jsonl"
    facts = {"dtype": ""}
    tl = Timeline(p)
    tl.start_header(lambda: {"kind": "run", **facts})
    tl.write({"kind": "attempt", "timestamp": 5.0})
    assert p.read_text() == "" and tl.held == 1
    facts["dtype"] = "bf16"  # learnt at the first forward, before the header is written
    tl.write_header()
    tl.advance(None)
    assert [r["kind"] for r in read_timeline(p)] == ["run", "attempt"]
    assert next(read_timeline(p))["dtype"] == "bf16"
    tl.close()


def test_a_record_stamped_after_the_watermark_waits_for_the_step_record(tmp_path):
    p = tmp_path / "t.jsonl"
    tl = Timeline(p)
    tl.advance(10.0)  # a step record stamped 10.0 or later may still come
    tl.write({"kind": "gpu", "timestamp": 9.0})  # before the watermark: written at once
    tl.write({"kind": "phase", "timestamp": 12.0})  # an eval after the steps the agent has not read yet
    assert _kinds(p) == [("gpu", 9.0)]
    tl.write_in_order({"kind": "step", "timestamp": 11.0})  # the steps before the eval
    assert _kinds(p) == [("gpu", 9.0), ("step", 11.0)]
    tl.write({"kind": "alert", "timestamp": 11.5})  # before the phase, after the watermark (11.0): waits
    tl.advance(13.0)
    assert _kinds(p) == [("gpu", 9.0), ("step", 11.0), ("alert", 11.5), ("phase", 12.0)]
    tl.advance(12.5)  # the watermark never moves back
    tl.write({"kind": "gpu", "timestamp": 13.5})  # at or after the watermark (13.0): waits
    assert tl.held == 1
    tl.close()  # close writes what waits
    assert _kinds(p)[-1] == ("gpu", 13.5) and tl.held == 0


def test_release_writes_what_waits_and_lets_later_records_straight_out(tmp_path):
    # the agent's close, after its last step record: the held records must reach the file before the close
    # waits on the network (a process killed during that wait keeps them)
    p = tmp_path / "t.jsonl"
    tl = Timeline(p)
    tl.start_header(lambda: {"kind": "run", "timestamp": 1.0})
    tl.write({"kind": "signal", "timestamp": 21.0})
    tl.write({"kind": "attempt", "timestamp": 2.0})
    assert p.read_text() == "" and tl.held == 2
    tl.release()  # the run record, then the held ones in timestamp order
    assert _kinds(p) == [("run", 1.0), ("attempt", 2.0), ("signal", 21.0)] and tl.held == 0
    tl.write_in_order({"kind": "step", "timestamp": 20.0})  # (a reporter pass that outlasted its close bound)
    tl.advance(30.0)
    tl.release()
    tl.write({"kind": "alert", "timestamp": 30.5})  # at/after the old watermark: out at once all the same
    assert _kinds(p)[-2:] == [("step", 20.0), ("alert", 30.5)] and tl.held == 0
    tl.release()  # idempotent
    tl.close()
    assert len(_kinds(p)) == 5


def test_no_record_waits_longer_than_max_hold(tmp_path):
    p = tmp_path / "t.jsonl"
    mono = FakeMonotonic()
    tl = Timeline(p, max_hold_seconds=15.0, monotonic=mono)
    tl.advance(100.0)
    tl.write({"kind": "hang", "timestamp": 120.0})  # the loop is stuck: no step record will move the watermark
    mono.t = 5.0
    tl.write({"kind": "phase", "timestamp": 110.0})
    mono.t = 14.9
    tl.advance(None)
    assert tl.held == 2
    mono.t = 15.0
    tl.advance(None)  # the hang record waited 15 s: out, after the earlier-stamped phase record
    assert _kinds(p) == [("phase", 110.0), ("hang", 120.0)]
    tl.close()


def test_the_run_record_waits_at_most_max_hold(tmp_path):
    p = tmp_path / "t.jsonl"
    mono = FakeMonotonic()
    tl = Timeline(p, monotonic=mono)
    tl.start_header(lambda: {"kind": "run", "dtype": ""})
    tl.write({"kind": "attempt", "timestamp": 1.0})
    mono.t = 14.0
    tl.advance(None)
    assert p.read_text() == ""
    mono.t = 15.0  # no forward after 15 s (a long checkpoint load): the run record goes with what is known
    tl.advance(None)
    assert [r["kind"] for r in read_timeline(p)] == ["run", "attempt"]
    tl.close()


def _demo_run(tmp_path, **cfg):
    import torch

    from mfuwatch.agent import Agent
    from mfuwatch.agent.demo import DemoLM, DemoShape

    s = DemoShape(vocab=32, d_model=16, n_layers=1, n_heads=2, d_ff=24, seq=6, batch=2)
    torch.manual_seed(0)
    model = DemoLM(s)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "tl.jsonl"
    a = Agent(model, opt, config=dict(exporter=False, nvml=False, alerts=False, profile_every="off", run="tl",
                                      report_every_steps=2, timeline=str(path), progress=False, peak_flops=1e11,
                                      **cfg))
    x = torch.randint(0, 32, (2, 6))

    def train(n):
        for _ in range(n):
            model(x).float().mean().backward()
            opt.step()
            opt.zero_grad()

    train(4)
    with a.phase("eval"):
        model.eval()
        with torch.no_grad():
            model(x)
        model.train()
    train(2)
    return a, path


def test_an_agent_writes_one_run_record_with_its_dtype_and_records_in_time_order(tmp_path):
    a, path = _demo_run(tmp_path)
    a.close()
    recs = list(read_timeline(path))
    runs = [r for r in recs if r["kind"] == "run"]
    assert len(runs) == 1 and recs[0] is runs[0]
    assert runs[0]["dtype"] == "fp32" and runs[0]["peak_flops_per_second"] == 1e11
    stamped = [r["timestamp"] for r in recs if r["kind"] != "run"]
    assert stamped == sorted(stamped)
    kinds = [(r["kind"], r.get("step")) for r in recs if r["kind"] in ("step", "phase")]
    assert kinds == [("step", 2), ("step", 4), ("phase", 4), ("step", 6)]  # the eval after step 4's record


def _wait(cond, timeout=20.0):
    import time

    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "the agent thread did not get there"
        time.sleep(0.05)


def test_facts_learnt_after_the_run_record_go_out_as_a_later_run_record(tmp_path):
    a, path = _demo_run(tmp_path)
    _wait(lambda: not a.timeline.header_pending)  # the agent thread has written the run record
    a.reporter.facts_changed()  # nothing changed: no second record
    _wait(lambda: not a.reporter.facts_pending)
    a.run_info.peak_source = "calibrated (fp32 matmul)"
    a.reporter.facts_changed()
    _wait(lambda: not a.reporter.facts_pending)
    a.close()
    runs = [r for r in read_timeline(path) if r["kind"] == "run"]
    assert [r["peak_source"] for r in runs] == ["user (peak_flops)", "calibrated (fp32 matmul)"]
    assert {(r["run"], r["rank"]) for r in runs} == {("tl", 0)}
