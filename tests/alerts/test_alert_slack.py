"""alerts/notifiers/slack.py: Block Kit content and Slack's limits, also for absurdly large groups.

The limits are Slack's published ones (api.slack.com/reference/block-kit/blocks), written
here independently of the notifier: 50 blocks per message; header plain_text ≤ 150
characters; section text ≤ 3000; section fields ≤ 10 items of ≤ 2000; context ≤ 10
elements.
"""

from __future__ import annotations

import time

from mfuwatch.alerts.config import parse_notifier
from mfuwatch.alerts.model import AlertSnapshot, Notification
from mfuwatch.alerts.notifiers.base import NotifierWorker
from mfuwatch.alerts.notifiers.slack import SlackNotifier, slack_message

APPLY = 'mfuwatch.kernels.patch(model, kernels=["rms_norm"])'


def block_kit_violations(message: dict) -> list:
    """Every way ``message`` breaks a documented Block Kit limit (empty list: valid)."""
    bad = []
    blocks = message.get("blocks", [])
    if not isinstance(message.get("text"), str) or not message["text"]:
        bad.append("no fallback text")
    if len(blocks) > 50:
        bad.append(f"{len(blocks)} blocks > 50")

    def text_obj(obj, limit, where, plain_only=False):
        if obj.get("type") not in (("plain_text",) if plain_only else ("plain_text", "mrkdwn")):
            bad.append(f"{where}: text type {obj.get('type')}")
        if not isinstance(obj.get("text"), str) or not obj["text"]:
            bad.append(f"{where}: empty text")
        elif len(obj["text"]) > limit:
            bad.append(f"{where}: {len(obj['text'])} chars > {limit}")

    for i, b in enumerate(blocks):
        t = b.get("type")
        if t == "header":
            text_obj(b["text"], 150, f"block {i} header", plain_only=True)
        elif t == "section":
            if "text" not in b and "fields" not in b:
                bad.append(f"block {i}: section without text or fields")
            if "text" in b:
                text_obj(b["text"], 3000, f"block {i} section")
            fields = b.get("fields", [])
            if len(fields) > 10:
                bad.append(f"block {i}: {len(fields)} fields > 10")
            for j, f in enumerate(fields):
                text_obj(f, 2000, f"block {i} field {j}")
        elif t == "context":
            els = b.get("elements", [])
            if not 1 <= len(els) <= 10:
                bad.append(f"block {i}: {len(els)} context elements")
            for j, e in enumerate(els):
                text_obj(e, 3000, f"block {i} element {j}")
        elif t == "divider":
            if set(b) != {"type"}:
                bad.append(f"block {i}: divider with extra keys")
        else:
            bad.append(f"block {i}: unknown type {t}")
    return bad


def mb_alert(**over):
    ctx = {"top_ops": [{"op": "aten::native_layer_norm", "share": 0.31, "time_seconds": 0.1},
                       {"op": "aten::add_", "share": 0.12, "time_seconds": 0.04}],
           "suggestions": [{"kernel": "rms_norm", "title": "Fused RMSNorm", "apply": APPLY, "expected_gain": 0.123,
                            "kind": "bundled", "ops": ["aten::native_layer_norm"]},
                           {"kernel": "torch_compile", "title": "torch.compile", "apply": "torch.compile(model)",
                            "expected_gain": 0.05, "kind": "existing", "ops": []}]}
    base = dict(name="MemoryBoundDominant", status="firing", severity="info",
                labels={"alertname": "MemoryBoundDominant", "severity": "info", "run": "run-a", "rank": "0",
                        "host": "node7"},
                annotations={"summary": "Memory-bound kernels take 62% of GPU time",
                             "runbook_url": "https://example.org/runbooks/MemoryBoundDominant.md"},
                starts_at=1_700_000_000.0, ends_at=None, value=0.62, threshold=0.4, op=">", unit="ratio",
                dashboard_url="http://localhost:3000/d/mfuwatch-training-mfu?var-run=run-a&var-rank=0",
                context=ctx)
    base.update(over)
    return AlertSnapshot(**base)


def all_text(message):
    out = []
    for b in message["blocks"]:
        for obj in [b.get("text")] + b.get("fields", []) + b.get("elements", []):
            if obj:
                out.append(obj["text"])
    return "\n".join(out)


def test_memory_bound_message_content():
    msg = slack_message(Notification({"run": "run-a"}, (mb_alert(),)))
    assert block_kit_violations(msg) == []
    assert msg["blocks"][0]["type"] == "header"
    assert msg["blocks"][0]["text"]["text"] == "[FIRING] MemoryBoundDominant · run run-a"
    text = all_text(msg)
    assert "aten::native_layer_norm  31%" in text and "aten::add_" in text  # the top-ops table
    assert "`rms_norm`" in text and APPLY in text and "*12.3%* of step time" in text  # fix, line, gain
    assert "`torch_compile` (5%)" in text
    assert "*Run*\n`run-a`" in text and "*Rank*\n0" in text and "*Host*\nnode7" in text
    assert "62% (threshold &gt; 40%)" in text  # the numbers that crossed
    assert "<https://example.org/runbooks/MemoryBoundDominant.md|Runbook>" in text
    assert "var-run=run-a&amp;var-rank=0|Grafana: run run-a>" in text


def test_bundled_drop_in_is_named_when_an_existing_fix_ranks_first():
    alert = mb_alert()
    sugg = alert.context["suggestions"]
    ctx = {**alert.context, "suggestions": [sugg[1], sugg[0]]}  # torch_compile first, as the agent ranks
    text = all_text(slack_message(Notification({"run": "run-a"}, (mb_alert(context=ctx),))))
    assert "*Suggested fix:* `torch_compile`" in text
    assert "*Bundled drop-in:* `rms_norm`" in text and APPLY in text and "*12.3%* of step time" in text


def test_resolved_message_drops_the_fix_and_says_resolved():
    msg = slack_message(Notification({"run": "run-a"}, (mb_alert(status="resolved", ends_at=1_700_000_600.0),)))
    assert block_kit_violations(msg) == []
    assert msg["blocks"][0]["text"]["text"].startswith("[RESOLVED] MemoryBoundDominant")
    text = all_text(msg)
    assert APPLY not in text and "(resolved)" in text and "*Resolved*\n2023-11-14 22:23:20 UTC" in text


def test_huge_groups_stay_within_limits():
    long = "x" * 10_000
    alerts = tuple(mb_alert(name=f"Alert{i}{long}", annotations={"summary": long, "runbook_url": "https://e/" + long},
                            labels={"run": long, "rank": "0", "host": long},
                            context={"top_ops": [{"op": long, "share": 0.5, "time_seconds": 1.0}] * 100,
                                     "suggestions": [{"kernel": long, "title": long, "apply": long,
                                                      "expected_gain": 0.5, "kind": "bundled", "ops": []}] * 20})
                   for i in range(60))
    msg = slack_message(Notification({"run": long}, alerts))
    assert block_kit_violations(msg) == []
    assert len(msg["blocks"]) <= 50
    assert "…and " in msg["blocks"][-1]["text"]["text"]  # the alerts that did not fit are named


def test_mrkdwn_is_escaped():
    msg = slack_message(Notification({"run": "r"}, (mb_alert(annotations={"summary": "<!channel> a & b"}),)))
    assert "&lt;!channel&gt; a &amp; b" in all_text(msg)
    assert "<!channel>" not in all_text(msg)


def test_slack_notifier_posts_the_message(receiver, monkeypatch):
    monkeypatch.setenv("MFUWATCH_TEST_SLACK_URL", receiver.url)
    cfg = parse_notifier({"type": "slack", "url_env": "MFUWATCH_TEST_SLACK_URL"}, "notifiers[0]", 10)
    worker = NotifierWorker(SlackNotifier(cfg), lambda s, o: None)
    worker.start()
    n = Notification({"run": "run-a"}, (mb_alert(),))
    worker.submit(n)
    assert receiver.wait_for_delivered(1, timeout=10)
    worker.close(time.monotonic() + 5)
    got = receiver.delivered[0]
    assert got.headers["Content-Type"] == "application/json" and got.json == slack_message(n)
    assert "Authorization" not in got.headers
