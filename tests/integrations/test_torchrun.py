"""``torchrun --nproc-per-node 2`` on the CPU (gloo) running ``mfuwatch demo``: two exporters on base port and
base port + 1, each series labelled with its own rank, and notifications sent by global rank 0 only.

The exporters are scraped over HTTP while the job runs. Alerts use one custom rule that fires as soon as a rank
reports MFU (``mfu > 0``, ``for: 0s``) and a webhook notifier pointed at a local receiver on 127.0.0.1: both
ranks fire the alert (their timelines record it), only rank 0 sends it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from helpers.net import free_port_pair, scrape
from helpers.receiver import AlertReceiver
from helpers.torchrun_config import write_observed_config

from mfuwatch.agent.live.timeline import read_timeline

RUN = "torchrun-ci"


def _value(samples, name, **labels):
    for (n, lab), v in samples.items():
        if n == name and all(dict(lab).get(k) == val for k, val in labels.items()):
            return v
    return None


@pytest.mark.slow
def test_torchrun_two_ranks_two_exporters_one_notification_sender(tmp_path):
    base = free_port_pair()
    config = tmp_path / "agent.yaml"
    write_observed_config(config, "info")
    timeline = tmp_path / "timeline.jsonl"
    with AlertReceiver() as rx:
        env = dict(os.environ, MFUWATCH_TEST_WEBHOOK_URL=rx.url, MFUWATCH_RUN=RUN, OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "-m", "mfuwatch.agent.cli", "demo", "--device", "cpu", "--steps", "150", "--batch", "4", "--seq", "64",
               "--port", str(base), "--profile-every", "off", "--report", "", "--log-every", "50",
               "--config", str(config), "--timeline", str(timeline), "--summary-json", str(tmp_path / "s.json")]
        proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        seen = {0: None, 1: None}
        try:
            deadline = time.monotonic() + 120
            # scrape both exporters while the job runs, until each shows trained steps and MFU, and rank 0 has
            # sent a notification
            while time.monotonic() < deadline and proc.poll() is None:
                for r in (0, 1):
                    s = scrape(f"http://127.0.0.1:{base + r}/metrics", down_ok=True)
                    # trained steps: an MFU, or one withheld as implausible (a CPU peak calibrated while the
                    # other rank computes can be too low: the MFU is then counted, not exported)
                    if s is not None and ((_value(s, "mfuwatch_mfu_ratio") or 0) > 0
                                          or (_value(s, "mfuwatch_implausible_ratio_total", ratio="mfu") or 0) > 0):
                        seen[r] = s
                sent = _value(seen[0], "mfuwatch_notifications_total", outcome="sent") if seen[0] else None
                if seen[1] is not None and sent:
                    break
                time.sleep(0.2)
            out, _ = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, out[-4000:]
        assert seen[0] is not None and seen[1] is not None, f"exporters not scraped while running\n{out[-3000:]}"

        # two exporters, on base and base + 1, each labelled with its own rank (and one run label each)
        runs = {}
        for r in (0, 1):
            series = [k for k in seen[r] if k[0].startswith("mfuwatch_")]
            assert series
            assert {dict(lab).get("rank") for _, lab in series} == {str(r)}
            runs[r] = {dict(lab).get("run") for _, lab in series}
            assert _value(seen[r], "mfuwatch_steps_total") > 0
            info = [dict(lab) for n, lab in seen[r] if n == "mfuwatch_run_info"][0]
            assert info["world_size"] == "2" and info["local_rank"] == str(r)
            assert info["exporter_url"] == f"http://127.0.0.1:{base + r}/metrics"
        # one notification sender: rank 0 has a notifier, rank 1 none
        # rank 0's scrape counts the sent notification (the exposition is re-rendered after each notification
        # outcome, so a scrape after the send sees it), and the receiver got it below
        assert _value(seen[0], "mfuwatch_notifications_total", outcome="sent") >= 1
        assert _value(seen[1], "mfuwatch_notifications_total") is None

        assert rx.wait_for_delivered(1, timeout=5)
        ranks = {a["labels"]["rank"] for req in rx.delivered for a in req.json["alerts"]}
        assert ranks == {"0"}

    # ... although both ranks fired the alert
    for r in (0, 1):
        records = list(read_timeline(tmp_path / f"timeline.rank{r}.jsonl"))
        assert records[0]["kind"] == "run" and records[0]["rank"] == r and records[0]["world_size"] == 2
        fired = [x for x in records if x["kind"] == "alert" and x["alertname"] == "TrainingObserved"
                 and x["status"] == "firing"]
        assert fired and fired[0]["labels"]["rank"] == str(r)
        steps = [x for x in records if x["kind"] == "step"]
        assert sum(x["steps"] for x in steps) == 150
        assert sum(x["tokens"] for x in steps) == 150 * 4 * 64

    # both ranks carry the job's run label ($MFUWATCH_RUN), so dashboards and the straggler rule group them
    assert runs[0] == runs[1] == {RUN}
