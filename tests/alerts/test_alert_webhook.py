"""alerts/notifiers/webhook.py: the Alertmanager webhook format, checked field by field against a real Alertmanager.

A local ``prometheus-alertmanager`` (Debian package) is given an alert through its API and
posts its own webhook to a test receiver; mfuwatch's body for the same alert must have
the same fields, fingerprint, group key and times.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import time
import urllib.request

from helpers.net import free_port
from helpers.receiver import AlertReceiver

from mfuwatch.alerts.model import AlertSnapshot, Notification, rfc3339
from mfuwatch.alerts.notifiers.webhook import webhook_body

TOP_KEYS = {"version", "groupKey", "truncatedAlerts", "status", "receiver", "groupLabels", "commonLabels",
            "commonAnnotations", "externalURL", "alerts"}
ALERT_KEYS = {"status", "labels", "annotations", "startsAt", "endsAt", "generatorURL", "fingerprint"}

LABELS = {"alertname": "MemoryBoundDominant", "severity": "info", "run": "run-a", "rank": "0", "host": "node7"}
ANNOTATIONS = {"summary": "Memory-bound kernels take 62% of GPU time", "suggested_kernel": "rms_norm"}
STARTS = 1_700_000_000.25


def snapshot(status="firing", labels=LABELS, annotations=ANNOTATIONS, ends=None):
    return AlertSnapshot(name=labels["alertname"], status=status, severity=labels["severity"], labels=labels,
                         annotations=annotations, starts_at=STARTS, ends_at=ends, value=0.62, threshold=0.4, op=">",
                         unit="ratio", generator_url="http://127.0.0.1:9478/metrics")


def parse_time(text):
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_body_fields_firing_and_resolved():
    other = {**LABELS, "alertname": "MfuLow", "severity": "warning"}
    n = Notification({"run": "run-a"}, (snapshot(), snapshot("resolved", other, {"summary": "low"}, STARTS + 60)),
                     external_url="http://127.0.0.1:9478")
    body = webhook_body(n, "oncall")
    assert set(body) == TOP_KEYS
    assert body["version"] == "4" and body["status"] == "firing" and body["receiver"] == "oncall"
    assert body["groupKey"] == '{}:{run="run-a"}' and body["truncatedAlerts"] == 0
    assert body["groupLabels"] == {"run": "run-a"}
    assert body["commonLabels"] == {"run": "run-a", "rank": "0", "host": "node7"}
    assert body["commonAnnotations"] == {}
    assert body["externalURL"] == "http://127.0.0.1:9478"
    firing, resolved = body["alerts"]
    assert set(firing) == ALERT_KEYS and set(resolved) == ALERT_KEYS
    assert firing["startsAt"] == "2023-11-14T22:13:20.250Z" and firing["endsAt"] == "0001-01-01T00:00:00Z"
    assert resolved["status"] == "resolved" and resolved["endsAt"] == "2023-11-14T22:14:20.250Z"
    assert firing["annotations"] == ANNOTATIONS and len(firing["fingerprint"]) == 16
    assert firing["fingerprint"] != resolved["fingerprint"]
    only_resolved = webhook_body(Notification({"run": "run-a"}, (snapshot("resolved", ends=STARTS + 1),)), "x")
    assert only_resolved["status"] == "resolved"
    json.dumps(body)  # JSON-serialisable as is


def _post(url, payload):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200


def test_same_format_as_a_real_alertmanager(alertmanager_bin, tmp_path):
    with AlertReceiver() as rx:
        cfg = tmp_path / "am.yml"
        cfg.write_text(f"""
route: {{receiver: hook, group_by: [run], group_wait: 0s, group_interval: 1s, repeat_interval: 1h}}
receivers:
  - name: hook
    webhook_configs: [{{url: "{rx.url}", send_resolved: true}}]
""")
        port = free_port()
        proc = subprocess.Popen([alertmanager_bin, f"--config.file={cfg}", f"--storage.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            for _ in range(200):
                try:
                    with urllib.request.urlopen(base + "/-/ready", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.05)
            alert = {"labels": LABELS, "annotations": ANNOTATIONS, "startsAt": rfc3339(STARTS),
                     "generatorURL": "http://127.0.0.1:9478/metrics"}
            _post(base + "/api/v2/alerts", [alert])
            assert rx.wait_for(1, timeout=30), "Alertmanager sent no webhook"
            _post(base + "/api/v2/alerts", [{**alert, "endsAt": rfc3339(STARTS + 60)}])
            assert rx.wait_for(2, timeout=30), "Alertmanager sent no resolved webhook"
        finally:
            proc.terminate()
            proc.wait(10)
    theirs_firing, theirs_resolved = rx.received[0].json, rx.received[1].json
    ours_firing = webhook_body(Notification({"run": "run-a"}, (snapshot(),), external_url=""), "hook")
    ours_resolved = webhook_body(Notification({"run": "run-a"}, (snapshot("resolved", ends=STARTS + 60),)), "hook")
    for ours, theirs in ((ours_firing, theirs_firing), (ours_resolved, theirs_resolved)):
        assert set(ours) == set(theirs)
        for key in ("version", "groupKey", "status", "receiver", "groupLabels", "commonLabels", "commonAnnotations",
                    "truncatedAlerts"):
            assert ours[key] == theirs[key], key
        (a,), (b,) = ours["alerts"], theirs["alerts"]
        assert set(a) == set(b)
        for key in ("status", "labels", "annotations", "generatorURL", "fingerprint"):
            assert a[key] == b[key], key
        assert parse_time(a["startsAt"]) == parse_time(b["startsAt"])
    assert theirs_firing["alerts"][0]["endsAt"] == ours_firing["alerts"][0]["endsAt"] == "0001-01-01T00:00:00Z"
    assert parse_time(ours_resolved["alerts"][0]["endsAt"]) == parse_time(theirs_resolved["alerts"][0]["endsAt"])
