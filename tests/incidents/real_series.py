"""The shipped Prometheus rules over series scraped from a real agent, through ``promtool test rules``.

:mod:`tests.incidents.replay` feeds promtool series a simulator writes; this module feeds it what a real
agent served: a file of scrapes (``benchmarks/checkpoint_replay.py`` writes one, a JSON line per scrape:
``{"t": unix seconds, "text": the /metrics exposition}``). Every sample of every scrape becomes a point of a
promtool input series (the exposition's own ``job``/``run``/``rank`` labels kept, as with ``honor_labels``,
plus ``instance``), one point per ``interval`` seconds from the first scrape (``_`` where a scrape is missing;
``_created`` samples are left out, as Prometheus ignores them in the text format). The rules are the ones the
project ships for the given alert-config overrides (``render_prometheus``) and the fleet rules
(``render_fleet``), evaluated every ``evaluation_interval``; every evaluation checks that no alert fires, so
promtool prints the ``ALERTS{alertstate="firing"}`` it finds.

    python -m tests.incidents.real_series SCRAPES.jsonl.gz [--for 20s]   # prints the alerts that fired
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml
from prometheus_client.parser import text_string_to_metric_families

from mfuwatch.alerts import load_config, render_prometheus
from mfuwatch.alerts.fleet_rules import render_fleet

_BLOCK = re.compile(r'time: (\S+),\s*exp: .*?\n\s*got: (.*)')
_SAMPLE = re.compile(r'\{([^}]*)\} (\S+)')
_ALERTS = 'group by (alertname, rank) (ALERTS{alertstate="firing"})'


def load(path: str) -> List[Tuple[float, str]]:
    """``[(unix seconds, exposition text)]`` of a scrape file (``.jsonl`` or ``.jsonl.gz``), in time order."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return sorted(((float(r["t"]), r["text"]) for r in rows), key=lambda x: x[0])


def _value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _escape(v: str) -> str:
    """A label value as a PromQL string literal's body (backslash, double quote and newline escaped)."""
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def series(scrapes: Sequence[Tuple[float, str]], interval: float = 1.0,
           instance: str = "gpu0:9478") -> Tuple[Dict[str, List[Optional[str]]], int]:
    """promtool input series of the scrapes: ``({selector: [value or None per interval]}, points)``."""
    if not scrapes:
        raise ValueError("no scrapes")
    t0 = scrapes[0][0]
    points = int(round((scrapes[-1][0] - t0) / interval)) + 1
    out: Dict[str, List[Optional[str]]] = {}
    for t, text in scrapes:
        i = int(round((t - t0) / interval))
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                labels = {**s.labels, "instance": instance}
                key = s.name + "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"
                out.setdefault(key, [None] * points)[i] = _value(s.value)
    return out, points


def promtool_doc(scrapes: Sequence[Tuple[float, str]], rule_files: Sequence[str], *, interval: float = 1.0,
                 evaluation_interval: float = 5.0) -> Dict[str, Any]:
    """A ``promtool test rules`` document: the scrapes as input series, an empty-expectation check of the firing
    alerts at every evaluation, and a sentinel (``count(mfuwatch_run_info)``) proving the series loaded."""
    ser, points = series(scrapes, interval)
    span = (points - 1) * interval
    checks = []
    t = 0.0
    while t <= span + 1e-9:
        checks.append({"expr": f'label_replace({_ALERTS}, "check", "alerts", "", "")', "eval_time": f"{t:g}s",
                       "exp_samples": []})
        t += evaluation_interval
    checks.append({"expr": 'label_replace(count(mfuwatch_run_info), "check", "sentinel", "", "")',
                   "eval_time": f"{min(10.0, span):g}s", "exp_samples": []})
    test = {"name": "real_series", "interval": f"{interval:g}s",
            "input_series": [{"series": k, "values": " ".join("_" if v is None else v for v in vals)}
                             for k, vals in sorted(ser.items())],
            "promql_expr_test": checks}
    return {"rule_files": list(rule_files), "evaluation_interval": f"{evaluation_interval:g}s", "tests": [test]}


def evaluate(scrapes: Sequence[Tuple[float, str]], promtool: str, rules: Optional[Dict[str, Any]] = None, *,
             interval: float = 1.0, evaluation_interval: float = 5.0) -> Dict[str, Any]:
    """Run the shipped rules (alert-config overrides ``rules``) and the fleet rules over the scrapes.

    Returns ``{"firing": {(alertname, rank): [seconds from the first scrape]}, "sentinel": count of run_info
    series seen, "evaluations": checks run}``. Raises RuntimeError when promtool fails other than by a check
    or the series did not load.
    """
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "rules.yml").write_text(render_prometheus(load_config({"notifiers": [], "rules": rules or {}})),
                                     encoding="utf-8")
        (d / "fleet.rules.yml").write_text(render_fleet(), encoding="utf-8")
        doc = promtool_doc(scrapes, ["rules.yml", "fleet.rules.yml"], interval=interval,
                           evaluation_interval=evaluation_interval)
        (d / "test.yml").write_text(yaml.safe_dump(doc, sort_keys=False, width=1 << 30), encoding="utf-8")
        proc = subprocess.run([promtool, "test", "rules", "test.yml"], cwd=d, capture_output=True, text=True,
                              timeout=600)
    printed = proc.stdout + proc.stderr
    if proc.returncode != 0 and "FAILED:" not in printed:
        raise RuntimeError(f"promtool failed: {printed[-4000:]}")
    firing: Dict[Tuple[str, str], List[float]] = {}
    sentinel = None
    for m in _BLOCK.finditer(printed):
        at = _seconds(m.group(1))
        for lab, value in _SAMPLE.findall(m.group(2)):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', lab))
            if labels.get("check") == "sentinel":
                sentinel = float(value)
            elif labels.get("check") == "alerts":
                firing.setdefault((labels.get("alertname", ""), labels.get("rank", "")), []).append(at)
    if not sentinel:
        raise RuntimeError(f"promtool did not load the series: {printed[-4000:]}")
    return {"firing": firing, "sentinel": sentinel, "evaluations": len(doc["tests"][0]["promql_expr_test"]) - 1}


def _seconds(text: str) -> float:
    """promtool's duration print (``1m25s``, ``45s``, ``0s``) in seconds."""
    total = 0.0
    for num, unit in re.findall(r"([\d.]+)(ms|h|m|s)", text):
        total += float(num) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}[unit]
    return total


def main(argv: Any = None) -> int:
    import shutil

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scrapes")
    ap.add_argument("--for", dest="for_s", default="20s", help="MfuAboveTensorActivity's for (default 20s)")
    ap.add_argument("--promtool", default=shutil.which("promtool") or "promtool")
    a = ap.parse_args(argv)
    scrapes = load(a.scrapes)
    got = evaluate(scrapes, a.promtool, {"MfuAboveTensorActivity": {"for": a.for_s}})
    print(f"{len(scrapes)} scrapes over {scrapes[-1][0] - scrapes[0][0]:.0f} s, {got['evaluations']} evaluations; "
          f"firing: " + ("none" if not got["firing"] else
                         "; ".join(f"{k[0]} rank {k[1]} at {v[0]:g}..{v[-1]:g} s" for k, v in got["firing"].items())))
    return 1 if got["firing"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
