"""Validation helpers for the alert configuration: the error type, key checks, durations, timestamps.

Every error names the field by its path in the YAML (``rules.MfuLow.for``,
``notifiers[1].type``), the accepted values, and for an unknown key the nearest
valid one (``difflib.get_close_matches``), so a typo fails at start-up with a
message that says how to fix it.
"""

from __future__ import annotations

import datetime as _dt
import difflib
import math
import re
from typing import Any, Iterable, Mapping, Optional, Sequence

__all__ = [
    "AlertConfigError", "check_keys", "parse_duration", "format_duration", "parse_timestamp",
    "require_mapping", "as_number", "as_bool", "as_str_list", "as_str_map", "LABEL_NAME_RE",
]

#: Prometheus label-name syntax (also used for alert names and annotation keys).
LABEL_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: One duration grammar for both config files (agent and alerts): Prometheus units, spelled-out units too,
#: with optional spaces: "250ms", "1h30m", "15 seconds", "5 min", "2 hours".
_UNIT_SECONDS = {"ms": 0.001, "msec": 0.001, "millisecond": 0.001, "milliseconds": 0.001,
                 "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
                 "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
                 "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "hour": 3600.0, "hours": 3600.0,
                 "d": 86400.0, "day": 86400.0, "days": 86400.0, "w": 604800.0, "week": 604800.0, "weeks": 604800.0}
_DURATION_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(" + "|".join(sorted(_UNIT_SECONDS, key=len, reverse=True))
                          + r")(?![a-z])\s*")


class AlertConfigError(ValueError):
    """The alert configuration is invalid. The message names the field and what it accepts."""


def check_keys(mapping: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    """Raise :class:`AlertConfigError` for the first key of ``mapping`` not in ``allowed``.

    The message names the key, the nearest allowed key (difflib) and the full list.
    """
    allowed = list(allowed)
    for key in mapping:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.5)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise AlertConfigError(
                f"{where}: unknown key {key!r}{hint}; accepted keys: {', '.join(sorted(allowed))}")


def require_mapping(value: Any, where: str) -> Mapping[str, Any]:
    """``value`` if it is a mapping (``None`` counts as empty), else :class:`AlertConfigError`."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise AlertConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def parse_duration(value: Any, where: str) -> float:
    """Seconds from a duration: Prometheus style (``"90s"``, ``"5m"``, ``"1h30m"``, ``"250ms"``), spelled-out
    units (``"15 seconds"``, ``"5 min"``, ``"2 hours"``) or a number of seconds.

    The one duration parser of both config files (the agent's ``profile_every`` uses it too).
    Raises :class:`AlertConfigError` (a ``ValueError``) for negative, non-finite or malformed values.
    """
    if isinstance(value, bool):
        raise AlertConfigError(f"{where}: expected a duration such as '30s', '5m', '1h30m' or seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip().lower()
        pos, seconds = 0, 0.0
        for m in _DURATION_RE.finditer(text):
            if m.start() != pos:
                break
            seconds += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
            pos = m.end()
        if pos != len(text):
            try:
                seconds = float(text)
            except ValueError:
                raise AlertConfigError(
                    f"{where}: cannot read {value!r} as a duration; use units ms, s, m, h, d, w "
                    f"(e.g. '30s', '5m', '1h30m', '15 seconds') or a number of seconds") from None
    else:
        raise AlertConfigError(f"{where}: expected a duration such as '30s', '5m', '1h30m' or seconds, got {value!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise AlertConfigError(f"{where}: a duration must be finite and >= 0, got {value!r}")
    return seconds


def check_url(value: str, where: str, *, echo: bool = True) -> str:
    """``value`` if it is an http(s) URL with a host and a port in 1..65535 (when given), else
    :class:`AlertConfigError`. With ``echo=False`` (a secret) the message never contains the value."""
    import urllib.parse

    shown = f" {value!r}" if echo else ""
    try:
        u = urllib.parse.urlsplit(value)
        port = u.port  # raises ValueError when out of 0..65535 or not a number
    except ValueError as exc:
        reason = "its port is not a number in 1..65535" if "port" in str(exc).lower() else "it is not a valid URL"
        raise AlertConfigError(f"{where}: the URL{shown} cannot be used: {reason}") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise AlertConfigError(f"{where}: expected an http(s) URL with a host name{', got' + shown if echo else ''}")
    if port == 0:
        raise AlertConfigError(f"{where}: the URL{shown} cannot be used: its port is not a number in 1..65535")
    return value


def format_duration(seconds: float) -> str:
    """A Prometheus duration string for ``seconds`` (``300 -> '5m'``, ``5400 -> '1h30m'``, ``0.25 -> '250ms'``).

    Rounded to whole milliseconds, the finest unit Prometheus durations have.
    """
    ms = int(round(seconds * 1000))
    if ms == 0:
        return "0s"
    out = []
    for unit, size in (("w", 604_800_000), ("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000),
                       ("ms", 1)):
        if ms >= size:
            out.append(f"{ms // size}{unit}")
            ms %= size
    return "".join(out)


def parse_timestamp(value: Any, where: str) -> float:
    """Unix seconds from an ISO 8601 timestamp (string or a YAML-parsed datetime; naive = UTC) or a number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)  # unix seconds
    if isinstance(value, _dt.datetime):
        ts = value
    elif isinstance(value, _dt.date):
        ts = _dt.datetime(value.year, value.month, value.day)
    elif isinstance(value, str):
        text = value.strip()
        if text.endswith("Z"):
            text = text[:-1] + "+00:00"
        try:
            ts = _dt.datetime.fromisoformat(text)
        except ValueError:
            raise AlertConfigError(
                f"{where}: cannot read {value!r} as a time; use ISO 8601 such as '2025-06-01T18:00:00Z'") from None
    else:
        raise AlertConfigError(f"{where}: expected an ISO 8601 time such as '2025-06-01T18:00:00Z', got {value!r}")
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=_dt.timezone.utc)
    return ts.timestamp()


def as_number(value: Any, where: str, *, minimum: Optional[float] = None, integer: bool = False) -> float:
    """A finite number (``int`` when ``integer``), at least ``minimum`` when given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise AlertConfigError(f"{where}: expected a {'whole ' if integer else ''}number, got {value!r}")
    if integer and float(value) != int(value):
        raise AlertConfigError(f"{where}: expected a whole number, got {value!r}")
    if minimum is not None and value < minimum:
        raise AlertConfigError(f"{where}: must be >= {minimum:g}, got {value!r}")
    return int(value) if integer else float(value)


def as_bool(value: Any, where: str) -> bool:
    """``value`` if it is ``true``/``false``."""
    if not isinstance(value, bool):
        raise AlertConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def as_str_list(value: Any, where: str, *, choices: Optional[Sequence[str]] = None) -> tuple:
    """A tuple of strings from a list (or one string); each in ``choices`` when given."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise AlertConfigError(f"{where}: expected a list of strings, got {value!r}")
    if choices is not None:
        for v in value:
            if v not in choices:
                near = difflib.get_close_matches(v, list(choices), n=1, cutoff=0.5)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise AlertConfigError(f"{where}: {v!r} is not accepted{hint}; accepted: {', '.join(choices)}")
    return tuple(value)


def as_str_map(value: Any, where: str, *, key_re: re.Pattern = LABEL_NAME_RE) -> dict:
    """A ``{str: str}`` dict whose keys match ``key_re``; scalar values are turned into strings."""
    mapping = require_mapping(value, where)
    out = {}
    for k, v in mapping.items():
        if not isinstance(k, str) or not key_re.match(k):
            raise AlertConfigError(f"{where}: {k!r} is not a valid name (letters, digits and '_', not first a digit)")
        if isinstance(v, (dict, list, tuple)) or v is None:
            raise AlertConfigError(f"{where}.{k}: expected a string, got {v!r}")
        out[k] = v if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)
    return out
