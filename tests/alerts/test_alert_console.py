"""Console notifier: each alert printed once when it fires, one line when it resolves (no fixes repeated)."""

from __future__ import annotations

from mfuwatch.alerts.config import parse_notifier
from mfuwatch.alerts.model import AlertSnapshot, Notification
from mfuwatch.alerts.notifiers.console import ConsoleNotifier

SUGGESTION = {"kernel": "rms_norm", "title": "t", "apply": 'mfuwatch.kernels.patch(model, kernels=["rms_norm"])',
              "expected_gain": 0.12, "kind": "bundled", "ops": []}


def snap(name, status, *, start=1000.0, end=None, **ann):
    labels = {"alertname": name, "severity": "warning", "run": "r", "rank": "0"}
    return AlertSnapshot(name=name, status=status, severity="warning", labels=labels,
                         annotations={"summary": f"{name} summary", **ann}, starts_at=start, ends_at=end,
                         value=0.5, threshold=0.4, op=">", unit="ratio", context={"suggestions": [SUGGESTION]})


def deliver(n, *alerts):
    return n.deliver(Notification({"run": "r"}, tuple(alerts)), lambda s: True, lambda: None)


def test_group_changes_do_not_reprint_and_resolved_is_one_line(capsys):
    n = ConsoleNotifier(parse_notifier({"type": "console", "stream": "stdout"}, "notifiers[0]", 10))
    deliver(n, snap("MfuLow", "firing"))
    deliver(n, snap("MfuLow", "firing"), snap("GpuThrottling", "firing"))  # a group change
    deliver(n, snap("MfuLow", "firing"), snap("GpuThrottling", "firing"), snap("InputStall", "firing"))
    deliver(n, snap("MfuLow", "firing"), snap("GpuThrottling", "firing"), snap("InputStall", "firing"))  # repeat
    deliver(n, snap("GpuThrottling", "firing"), snap("InputStall", "firing"),
            snap("MfuLow", "resolved", end=1090.0, resolved_reason="run ended"))
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert sum(line.startswith("[mfuwatch] FIRING MfuLow") for line in lines) == 1  # printed once, not 4x
    assert out.count("MfuLow summary") == 1
    assert out.count("fix: rms_norm") == 3  # one per alert that fired, never again
    assert "[mfuwatch] still firing: MfuLow, GpuThrottling, InputStall (run=r)" in lines  # the repeat: one line
    (resolved,) = [line for line in lines if "RESOLVED" in line]
    assert resolved == "[mfuwatch] RESOLVED MfuLow (warning) run=r rank=0 host=  (after 1m 30s; run ended)"
    after = out[out.index("RESOLVED"):]
    assert "fix:" not in after and "summary" not in after  # the fixes are not repeated on resolve


def test_an_alert_that_fires_again_after_resolving_is_printed_again(capsys):
    n = ConsoleNotifier(parse_notifier({"type": "console", "stream": "stdout"}, "notifiers[0]", 10))
    deliver(n, snap("MfuLow", "firing"))
    deliver(n, snap("MfuLow", "resolved", end=1010.0))
    deliver(n, snap("MfuLow", "firing", start=2000.0))
    out = capsys.readouterr().out
    assert out.count("FIRING MfuLow") == 2 and out.count("RESOLVED MfuLow") == 1
