"""Annotation templates that render the same text in the engine and in Prometheus.

A rule's annotations (``summary``, ``description``, …) are written once, with a
small placeholder syntax, and rendered two ways:

* :meth:`Template.render` — by the in-process engine, with the alert's value,
  labels and the latest profiler window's suggestion;
* :meth:`Template.to_go` — into Go ``text/template`` for the generated Prometheus
  alerting rules (``$value``, ``$labels``, and a ``query`` for the suggestion).

Placeholders (``{{`` and ``}}`` stand for literal braces):

==========================  =================================================================
``{value}``                 the alert expression's value, 4 significant digits
``{value:pct}``             as a percentage (Prometheus ``humanizePercentage``)
``{value:duration}``        as a duration (Prometheus ``humanizeDuration``)
``{value:int}``             rounded to a whole number
``{threshold}`` (…``:pct``, ``:duration``, ``:int``)   the rule's threshold
``{for}`` ``{window}`` ``{offset}`` ``{cooldown}``    the rule's durations as written (``10m``, ``1h``)
``{op}`` ``{alertname}`` ``{severity}``              the rule's comparison, name, severity
``{labels.NAME}``           a label of the alert (``run``, ``rank``, …)
``{suggestion}``            the agent's first-ranked suggestion (existing fixes first, then by expected
                            gain): ``"rms_norm (expected gain 12.3% of step time)"``
==========================  =================================================================

The number formats follow Prometheus's template functions (``humanizePercentage``
is ``%.4g`` of the value × 100 followed by ``%``; ``humanizeDuration`` prints
``1d 2h 3m 4s``, ``1m 30s``, ``12.5s``, ``300ms``), so the in-process text and the
Prometheus text agree for the same value.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from mfuwatch.agent.schema import M

from .validation import AlertConfigError, format_duration

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?)(?::([a-z]+))?\}")
_NUMBER_FORMATS = ("g", "pct", "duration", "int")
_STATIC_DURATIONS = ("for", "window", "offset", "cooldown")
_STATIC_WORDS = ("op", "alertname", "severity")


def fmt_g(v: float) -> str:
    """``%.4g`` (Prometheus ``printf "%.4g"``)."""
    return "%.4g" % v


def fmt_pct(v: float) -> str:
    """Prometheus ``humanizePercentage``: ``%.4g`` of ``v * 100`` and a ``%`` sign."""
    return "%.4g%%" % (v * 100.0)


def fmt_duration(v: float) -> str:
    """Prometheus ``humanizeDuration``: ``1d 2h 3m 4s`` above a minute, ``12.5s``, ``300ms`` below a second."""
    if math.isnan(v) or math.isinf(v):
        return "%.4g" % v
    if abs(v) >= 1:
        sign = "-" if v < 0 else ""
        whole = int(abs(v))
        seconds, minutes = whole % 60, (whole // 60) % 60
        hours, days = (whole // 3600) % 24, whole // 86400
        if days:
            return f"{sign}{days}d {hours}h {minutes}m {seconds}s"
        if hours:
            return f"{sign}{hours}h {minutes}m {seconds}s"
        if minutes:
            return f"{sign}{minutes}m {seconds}s"
        return "%s%.4gs" % (sign, abs(v))
    if v == 0:
        return "0s"
    prefix = ""
    for p in ("m", "u", "n", "p", "f", "a", "z", "y"):
        if abs(v) >= 1:
            break
        prefix, v = p, v * 1000
    return "%.4g%ss" % (v, prefix)


def fmt_int(v: float) -> str:
    """Rounded to a whole number (``printf "%.0f"``)."""
    return "%.0f" % v


FORMATTERS: Dict[str, Callable[[float], str]] = {"g": fmt_g, "pct": fmt_pct, "duration": fmt_duration, "int": fmt_int}
_GO_PIPES = {"g": 'printf "%.4g"', "pct": "humanizePercentage", "duration": "humanizeDuration", "int": 'printf "%.0f"'}


def format_suggestion(kernel: str, expected_gain: float) -> str:
    """The one-line form of a suggestion used by ``{suggestion}`` in both paths."""
    return f"{kernel} (expected gain {fmt_pct(expected_gain)} of step time)"


#: the gain of the suggestion the agent ranks first (``mfuwatch_suggestion_order`` 1), as the engine's
#: ``{suggestion}`` names it; not ``topk`` of the gains, which can name a drop-in ranked below an existing fix
_GO_SUGGESTION = (
    '{{ with printf "' + M.SUGGESTION_EXPECTED_GAIN + '{run=%q,rank=%q} and on(kernel) bottomk(1, '
    + M.SUGGESTION_ORDER + '{run=%q,rank=%q})" $labels.run $labels.rank $labels.run $labels.rank | query }}'
    "{{ with first . }}{{ .Labels.kernel }} (expected gain {{ .Value | humanizePercentage }} of step time){{ end }}"
    "{{ else }}none recorded{{ end }}"
)


class Template:
    """One annotation template, parsed once at config load.

    Raises :class:`AlertConfigError` (naming ``where``) for an unknown placeholder,
    an unknown format or an unmatched brace.
    """

    def __init__(self, text: str, where: str) -> None:
        self.text = text
        self.parts: List[Tuple[str, Any]] = []  # ("lit", str) | ("ph", (name, fmt))
        i, lit = 0, []
        while i < len(text):
            if text.startswith("{{", i) or text.startswith("}}", i):
                lit.append(text[i])
                i += 2
                continue
            if text[i] == "{":
                m = _PLACEHOLDER.match(text, i)
                if not m:
                    raise AlertConfigError(f"{where}: unreadable placeholder at {text[i:i + 24]!r}; write "
                                           "'{{' for a literal brace")
                name, fmt = m.group(1), m.group(2)
                _check_placeholder(name, fmt, where)
                if lit:
                    self.parts.append(("lit", "".join(lit)))
                    lit = []
                self.parts.append(("ph", (name, fmt)))
                i = m.end()
                continue
            if text[i] == "}":
                raise AlertConfigError(f"{where}: unmatched '}}' at position {i}; write '}}}}' for a literal brace")
            lit.append(text[i])
            i += 1
        if lit:
            self.parts.append(("lit", "".join(lit)))

    def render(self, *, value: Optional[float], labels: Mapping[str, str], static: Mapping[str, Any],
               suggestion: Optional[Tuple[str, float]] = None) -> str:
        """The text for the in-process engine.

        ``static`` holds the rule's threshold (float), durations in seconds (``for``,
        ``window``, ``offset``, ``cooldown``) and words (``op``, ``alertname``,
        ``severity``); ``suggestion`` is ``(kernel, expected_gain)`` or ``None``.
        """
        out = []
        for kind, item in self.parts:
            if kind == "lit":
                out.append(item)
                continue
            name, fmt = item
            if name == "value":
                out.append("n/a" if value is None else FORMATTERS[fmt or "g"](value))
            elif name == "suggestion":
                out.append(format_suggestion(*suggestion) if suggestion else "none recorded")
            elif name.startswith("labels."):
                out.append(str(labels.get(name[7:], "")))
            else:
                out.append(_static_text(name, fmt, static))
        return "".join(out)

    def to_go(self, static: Mapping[str, Any]) -> str:
        """The text as a Prometheus (Go ``text/template``) annotation."""
        out = []
        for kind, item in self.parts:
            if kind == "lit":
                out.append(item.replace("{", '{{ "{" }}'))
                continue
            name, fmt = item
            if name == "value":
                out.append("{{ $value | " + _GO_PIPES[fmt or "g"] + " }}")
            elif name == "suggestion":
                out.append(_GO_SUGGESTION)
            elif name.startswith("labels."):
                out.append("{{ $labels." + name[7:] + " }}")
            else:
                out.append(_static_text(name, fmt, static).replace("{", '{{ "{" }}'))
        return "".join(out)


def _check_placeholder(name: str, fmt: Optional[str], where: str) -> None:
    accepted = ("value, threshold, for, window, offset, cooldown, op, alertname, severity, labels.NAME, suggestion")
    if name in ("value", "threshold"):
        if fmt is not None and fmt not in _NUMBER_FORMATS:
            raise AlertConfigError(f"{where}: unknown format {fmt!r} in {{{name}:{fmt}}}; accepted: "
                                   f"{', '.join(_NUMBER_FORMATS)}")
    elif name in _STATIC_DURATIONS or name in _STATIC_WORDS or name == "suggestion" or name.startswith("labels."):
        if fmt is not None:
            raise AlertConfigError(f"{where}: {{{name}}} takes no format, got {{{name}:{fmt}}}")
    else:
        raise AlertConfigError(f"{where}: unknown placeholder {{{name}}}; accepted: {accepted}")


def _static_text(name: str, fmt: Optional[str], static: Mapping[str, Any]) -> str:
    # Values fixed by the rule print the same in both paths; durations read as the config wrote them ("10m").
    if name == "threshold":
        v = float(static["threshold"])
        return format_duration(v) if fmt == "duration" else FORMATTERS[fmt or "g"](v)
    if name in _STATIC_DURATIONS:
        v = static.get(name)
        return "n/a" if v is None else format_duration(float(v))
    return str(static.get(name, ""))
