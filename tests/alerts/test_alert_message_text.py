"""What every chat/mail notifier shows of an alert's text: a user-written ``description`` annotation and a
hand-written ``suggested_apply`` fix (findings 12 and 13 of the fresh-user pass), and the same wording
across vendors (``[RESOLVED]``, ``Runbook:``, a PagerDuty summary that does not repeat the run)."""

from __future__ import annotations

import json

from test_alert_slack import mb_alert
from test_alert_vendors import group, stall_alert

from mfuwatch.alerts.notifiers.console import alert_lines
from mfuwatch.alerts.notifiers.discord import MAX_DESCRIPTION, discord_message
from mfuwatch.alerts.notifiers.mail import html_body, text_body
from mfuwatch.alerts.notifiers.slack import slack_message
from mfuwatch.alerts.notifiers.teams import teams_message

DESCRIPTION = "\n".join(f"step {i}: what to look at next ({i * 7} ms)" for i in range(600))  # 600 lines
APPLY = 'model = torch.compile(model, mode="max-autotune")'


def hand_written():
    """MfuLow with a 600-line description and a fix written by hand in its annotations (no suggestions)."""
    return mb_alert(name="MfuLow", severity="warning", context={},
                    labels={"alertname": "MfuLow", "severity": "warning", "run": "run-a", "rank": "0", "host": "h"},
                    annotations={"summary": "MFU 12% on run run-a", "description": DESCRIPTION,
                                 "suggested_apply": APPLY, "runbook_url": "https://example.org/rb/MfuLow.md"})


def test_a_description_and_a_hand_written_fix_reach_chat_email_and_console():
    n = group(hand_written())
    rendered = {"slack": json.dumps(slack_message(n)), "teams": json.dumps(teams_message(n)),
                "discord": json.dumps(discord_message(n)), "email text": text_body(n), "email html": html_body(n),
                "console": "\n".join(alert_lines(n.alerts[0]))}
    for where, text in rendered.items():
        text = text.replace("\\n", "\n").replace("\\\"", '"')
        assert "step 0: what to look at next (0 ms)" in text, where  # the description is there ...
        assert "more line(s)" in text, where  # ... cut by whole lines, saying so
        assert "step 599" not in text, where
        assert APPLY in text.replace("&quot;", '"'), where  # the hand-written fix, whole
    embed = discord_message(n)["embeds"][0]
    assert len(embed["description"]) <= MAX_DESCRIPTION
    assert embed["description"].index(APPLY) < embed["description"].index("step 0:")  # fix first, never pushed out


def test_headers_and_runbook_wording_agree_across_vendors():
    resolved = [mb_alert(name=f"A{i}", status="resolved", ends_at=1_700_000_200.0) for i in range(3)]
    n = group(*resolved)
    assert slack_message(n)["blocks"][0]["text"]["text"] == "[RESOLVED] 3 alerts · run run-a"  # was [RESOLVED:0]
    assert discord_message(n)["content"].startswith("[RESOLVED] 3 alerts")
    firing = alert_lines(hand_written())
    assert any(x.startswith("  Runbook: https://example.org/rb/MfuLow.md") for x in firing)
    assert not any("runbook:" in x for x in firing)


def test_pagerduty_summary_does_not_repeat_the_run():
    from mfuwatch.alerts.notifiers.pagerduty import pd_summary

    assert pd_summary(stall_alert()) == "TrainingStalled: No training step for 12m on run run-a rank 0"
    other = mb_alert(annotations={"summary": "memory-bound ops take 61% of GPU time"})
    assert pd_summary(other) == "MemoryBoundDominant on run run-a rank 0: memory-bound ops take 61% of GPU time"


def test_a_run_name_with_cr_lf_stays_one_line_in_every_title_and_source():
    from mfuwatch.alerts.model import Notification
    from mfuwatch.alerts.notifiers.pagerduty import trigger_event

    evil = "evil\r\nBcc: x@example.org"
    a = stall_alert(labels={**stall_alert().labels, "run": evil})
    n = Notification({"run": evil}, (a,))
    titles = [slack_message(n)["blocks"][0]["text"]["text"], discord_message(n)["content"].splitlines()[0],
              trigger_event(a, "k" * 32, {})["payload"]["source"]]
    for t in titles:
        assert "\r" not in t and "evil Bcc: x@example.org" in t, t
