"""alerts/templates.py: placeholder rendering in Python and into Prometheus Go templates."""

from __future__ import annotations

import pytest

from mfuwatch.alerts import AlertConfigError
from mfuwatch.alerts.templates import Template, fmt_duration, fmt_pct

STATIC = {"threshold": 0.4, "for": 600.0, "window": 3600.0, "offset": None, "cooldown": 0.0, "op": ">",
          "alertname": "A", "severity": "info"}


@pytest.mark.parametrize("seconds, text", [
    (0.3, "300ms"), (0.0, "0s"), (12.5, "12.5s"), (90, "1m 30s"), (3600, "1h 0m 0s"), (93784, "1d 2h 3m 4s"),
    (0.0025, "2.5ms"), (-90, "-1m 30s"),
])
def test_fmt_duration_matches_prometheus_humanize_duration(seconds, text):
    # values and strings from Prometheus's humanizeDuration rules (days/h/m/s, then 4 significant digits)
    assert fmt_duration(seconds) == text


@pytest.mark.parametrize("value, text", [(0.5, "50%"), (0.1234567, "12.35%"), (0.0, "0%"), (1.0, "100%")])
def test_fmt_pct_matches_humanize_percentage(value, text):
    assert fmt_pct(value) == text


def test_render_all_placeholders():
    t = Template("{alertname} {value:pct} {op} {threshold:pct} for {for}, window {window}; offset {offset}; "
                 "run {labels.run}/{labels.rank} v={value} n={value:int} {{literal}} {suggestion}", "x")
    out = t.render(value=0.61234, labels={"run": "r", "rank": "2"}, static=STATIC, suggestion=("rms_norm", 0.1))
    assert out == ("A 61.23% > 40% for 10m, window 1h; offset n/a; run r/2 v=0.6123 n=1 {literal} "
                   "rms_norm (expected gain 10% of step time)")
    assert Template("{suggestion}", "x").render(value=None, labels={}, static=STATIC) == "none recorded"
    assert Template("{value}", "x").render(value=None, labels={}, static=STATIC) == "n/a"


def test_to_go_uses_value_labels_and_query():
    t = Template("{value:pct} {value:duration} {value} {labels.run} {threshold:pct} {{x}} {suggestion}", "x")
    go = t.to_go(STATIC)
    assert go.startswith('{{ $value | humanizePercentage }} {{ $value | humanizeDuration }} '
                         '{{ $value | printf "%.4g" }} {{ $labels.run }} 40% {{ "{" }}x} ')
    # the first-ranked suggestion (mfuwatch_suggestion_order 1), not the largest gain
    assert ('mfuwatch_suggestion_expected_gain_ratio{run=%q,rank=%q} and on(kernel) '
            'bottomk(1, mfuwatch_suggestion_order{run=%q,rank=%q})') in go
    assert "topk" not in go
    assert "{{ .Labels.kernel }}" in go


@pytest.mark.parametrize("text, needle", [("{nope}", "unknown placeholder"), ("{value:hex}", "unknown format"),
                                          ("{for:pct}", "takes no format"), ("a } b", "unmatched"),
                                          ("{ value}", "unreadable placeholder")])
def test_bad_templates_are_config_errors(text, needle):
    with pytest.raises(AlertConfigError, match=needle):
        Template(text, "rules.X.annotations.summary")
