"""The incident corpus, replayed through the in-process engine and the shipped Prometheus rules.

Each scenario of ``tests/incidents/scenarios`` lists the pages it must raise and resolve, with their
timing; :mod:`tests.incidents.replay` drives both paths from the same simulated ranks (one promtool run
for the whole corpus) and judges each path against the scenario. The table in docs/reliability.md is
generated from the same replay and must be current.

The last tests run the generator with the behaviour issue 24 found (the cross-check against the latest
NVML sample, a stall clock restarted by reports, durations on the wall clock) and show that the corpus
pages where the real incidents paged: the judge can fail.
"""

from __future__ import annotations

import pytest

from mfuwatch.agent.schema import GpuHealth
from mfuwatch.alerts.signals import MeasurementStore
from mfuwatch.alerts.stall import StallClock
from tests.helpers.debian_tools import ensure_binary
from tests.incidents import replay as R


@pytest.fixture(scope="module")
def rows():
    promtool = ensure_binary(("promtool",), "prometheus")
    return R.replay_all(promtool)


def test_every_scenario_pages_as_expected_on_both_paths(rows):
    assert R.failures(rows) == []


def test_both_paths_page_alike(rows):
    for row in rows:
        if "series" in row or row["key"] is None:
            continue
        eng, prom = row["paths"]["engine"], row["paths"]["prometheus"]
        if "na" in eng:  # only what one process cannot see
            assert row["key"][2] or row["key"][0] in R.PROMETHEUS_ONLY, row
            continue
        if row["expect"] is not None and len(row["expect"].get("paths", ["engine", "prometheus"])) == 1:
            assert row["expect"].get("note"), row  # a difference between the paths says why
            continue
        # the same pages; a boundary may fall one check apart (the engine evaluates every 15 s and its stall
        # watchdog every second, Prometheus at each 30 s scrape)
        assert len(eng["runs"]) == len(prom["runs"]), row
        for (a0, a1), (b0, b1) in zip(eng["runs"], prom["runs"]):
            assert abs(a0 - b0) <= R.SCRAPE and abs(a1 - b1) <= R.SCRAPE, row


def test_the_table_in_reliability_md_is_current(rows):
    assert R.doc_section(R.DOC.read_text(encoding="utf-8")) == R.table(rows), \
        "stale: run `python -m tests.incidents.replay --write`"


def test_the_corpus_covers_the_incidents_of_issue_24():
    names = {sc["name"] for sc in R.scenarios()}
    assert {"healthy_2h", "eval_30m_phase", "checkpoint_20m_phase", "checkpoint_20m_torch_save",
            "eval_without_phase", "input_stall", "hang_in_collective", "sigterm_restart", "short_job",
            "ended_agent_open", "gpu_throttling", "mfu_regression_code_change", "slow_rank", "clock_steps",
            "gap_2h_resume", "issue24_checkpoint", "stall_one_page", "low_goodput_clean_end"} <= names
    healthy = next(sc for sc in R.scenarios() if sc["name"] == "healthy_2h")
    assert healthy["duration"] == 7200 and healthy["expect"] == []


def _engine_problems(name):
    sc = next(sc for sc in R.scenarios() if sc["name"] == name)
    firing, episodes, _ = R.simulate(sc)
    return R.judge(sc, R._pages(firing, R.alert_config(sc)), "engine", episodes)


def test_as_expected_with_todays_code():
    for name in ("issue24_checkpoint", "stall_one_page", "clock_steps"):
        assert not any(_engine_problems(name).values()), name


def test_the_old_cross_check_against_the_latest_sample_pages_during_the_checkpoint(monkeypatch):
    def latest_sample(self, signal, now):  # the cross-check before issue 24: MFU held, GPM of the last second
        m, g = self.step, self.gpu
        if m is None or m.mfu is None or g is None or g.tensor_active is None:
            return None
        return float(m.mfu) - float(g.tensor_active) * float(g.sm_clock_hertz) / float(g.sm_clock_max_hertz)

    monkeypatch.setattr(MeasurementStore, "_tensor_active_check", latest_sample)
    problems = _engine_problems("issue24_checkpoint")
    assert any("false page" in m for m in problems[("MfuAboveTensorActivity", "0", "")]), problems


def test_a_stall_clock_restarted_by_reports_pages_twice(monkeypatch):
    def any_report(self, t=None):  # before issue 24: every report (and nothing else) restarted the stall clock
        t = self._now() if t is None else float(t)
        self.last_progress = t

    monkeypatch.setattr(StallClock, "report", any_report)
    monkeypatch.setattr(StallClock, "step", lambda self, t=None: None)
    problems = _engine_problems("stall_one_page")
    assert any("episodes" in m or "transitions" in m for m in problems[("TrainingStalled", "0", "")]), problems


def test_durations_on_the_wall_clock_page_on_a_clock_step(monkeypatch):
    monkeypatch.setattr(R._Clocks, "mono", R._Clocks.wall)  # before issue 24: time.time() timed the stall
    problems = _engine_problems("clock_steps")
    assert any(problems.values()), problems


def test_gpu_samples_survive_a_backward_clock_step():
    from mfuwatch.agent.activity import ActivityAverager

    a = ActivityAverager()
    for t in range(10):
        a.add(GpuHealth(timestamp=1000.0 + t, tensor_active=0.5, sm_clock_hertz=1.0, sm_clock_max_hertz=2.0))
    for t in range(10):  # the clock stepped back by 600 s: the next sample starts a new run of stamps
        a.add(GpuHealth(timestamp=400.0 + t, tensor_active=0.8, sm_clock_hertz=2.0, sm_clock_max_hertz=2.0))
    avg = a.average(402.0, 409.0)
    assert avg is not None and avg.tensor_active == pytest.approx(0.8) and avg.tensor_active_bound == pytest.approx(0.8)


def test_job_series_read_over_their_whole_range_outlive_the_job(monkeypatch):
    """Without the scrape gate (issue 24: GoodputLow 27.5 minutes after a clean end) the corpus sees it."""
    from mfuwatch.alerts import fleet_rules

    promtool = ensure_binary(("promtool",), "prometheus")
    monkeypatch.setattr(fleet_rules, "_live", lambda expr, by: expr)
    rows = R.replay_all(promtool, [sc for sc in R.scenarios() if sc["name"] == "low_goodput_clean_end"])
    assert any("resolved late" in line and "GoodputLow" in line for line in R.failures(rows)), R.failures(rows)
