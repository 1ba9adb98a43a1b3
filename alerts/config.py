"""The alert configuration: schema, defaults and validation (``load_config``).

The configuration is YAML (or the same data as a dict). Every key is optional;
what is given is merged onto the shipped defaults
(``mfuwatch/alerts/data/default_rules.yaml``): top-level settings replace the
defaults, ``rules`` merge per alert name and per key, and the lists
(``notifiers``, ``inhibit_rules``, ``silences``) replace the default lists::

    evaluation_interval: 15s
    repeat_interval: 4h
    notify_from_all_ranks: false
    grafana_url: http://grafana.internal:3000
    notifiers:
      - type: slack
        url_env: MFUWATCH_SLACK_WEBHOOK_URL        # or url_file: /run/secrets/slack_webhook
      - type: webhook
        url_file: /run/secrets/alert_webhook_url
        token_env: ALERT_WEBHOOK_TOKEN             # optional, sent as "Authorization: Bearer …"
        severities: [critical]
    silences:
      - matchers: ['alertname="MfuLow"', 'rank="3"']
        until: 2025-06-01T18:00:00Z
    rules:
      MfuLow: {threshold: 0.3}

A file may also be an agent config whose ``alerts:`` key holds this mapping.
Secrets are never literal in the config: a notifier names the environment
variable or the file that holds its URL or token, so :meth:`AlertConfig.to_dict`
is safe to print.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import yaml

from .matchers import InhibitRule, Silence, parse_inhibit_rules, parse_silences
from .rules import SEVERITIES, Rule, load_default_document, merge_rules
from .validation import (AlertConfigError, as_bool, as_number, as_str_list, check_keys, check_url,
                         format_duration, parse_duration, require_mapping)

__all__ = ["AlertConfig", "NotifierConfig", "AlertConfigError", "load_config", "TOP_KEYS", "NOTIFIER_TYPES"]

TOP_KEYS = ("evaluation_interval", "watchdog_interval", "repeat_interval", "group_by", "notify_from_all_ranks",
            "queue_size", "runbook_base_url", "grafana_url", "notifiers", "inhibit_rules", "silences", "rules",
            "use_default_rules")
NOTIFIER_TYPES = ("console", "slack", "webhook")
NOTIFIER_KEYS = ("type", "name", "url_env", "url_file", "token_env", "token_file", "timeout", "max_retries",
                 "backoff", "max_backoff", "queue_size", "send_resolved", "severities", "stream")
_HTTP_ONLY = ("url_env", "url_file", "timeout", "max_retries", "backoff", "max_backoff")
STREAMS = ("stderr", "stdout", "log")


@dataclass(frozen=True)
class NotifierConfig:
    """One notifier. ``url_env``/``url_file`` (and ``token_*``) say where the secret is, never what it is.

    HTTP timing: each request times out after ``timeout_seconds``; connection
    errors, timeouts, 408, 429 and 5xx are retried after ``backoff_seconds * 2**attempt``
    (capped at ``max_backoff_seconds``, with jitter), or after the ``Retry-After`` the
    receiver asks for (capped likewise), until delivered or superseded by a newer
    state of the same group (``max_retries: None``, the default, as Alertmanager), or
    at most ``max_retries`` times when it is set.
    """

    type: str
    name: str
    url_env: Optional[str] = None
    url_file: Optional[str] = None
    token_env: Optional[str] = None
    token_file: Optional[str] = None
    timeout_seconds: float = 5.0
    max_retries: Optional[int] = None  # None: retry until delivered or superseded
    backoff_seconds: float = 0.5
    max_backoff_seconds: float = 30.0
    queue_size: int = 100
    send_resolved: bool = True
    severities: Tuple[str, ...] = SEVERITIES
    stream: str = "stderr"

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"type": self.type, "name": self.name}
        for k in ("url_env", "url_file", "token_env", "token_file"):
            if getattr(self, k):
                d[k] = getattr(self, k)
        if self.type != "console":
            d.update(timeout=format_duration(self.timeout_seconds),
                     max_retries="unlimited" if self.max_retries is None else self.max_retries,
                     backoff=format_duration(self.backoff_seconds),
                     max_backoff=format_duration(self.max_backoff_seconds))
        else:
            d["stream"] = self.stream
        d.update(queue_size=self.queue_size, send_resolved=self.send_resolved, severities=list(self.severities))
        return d


@dataclass(frozen=True)
class AlertConfig:
    """The validated alert configuration (durations in seconds)."""

    evaluation_interval_seconds: float
    watchdog_interval_seconds: float
    repeat_interval_seconds: float
    group_by: Tuple[str, ...]
    notify_from_all_ranks: bool
    queue_size: int
    runbook_base_url: str
    grafana_url: str
    rules: Tuple[Rule, ...]
    notifiers: Tuple[NotifierConfig, ...] = ()
    inhibit_rules: Tuple[InhibitRule, ...] = ()
    silences: Tuple[Silence, ...] = ()

    def rule(self, name: str) -> Rule:
        """The rule called ``name`` (``KeyError`` if there is none)."""
        for r in self.rules:
            if r.name == name:
                return r
        raise KeyError(name)

    def to_dict(self) -> Dict[str, Any]:
        """The effective configuration as YAML-ready data. Holds no secret values."""
        return {
            "evaluation_interval": format_duration(self.evaluation_interval_seconds),
            "watchdog_interval": format_duration(self.watchdog_interval_seconds),
            "repeat_interval": format_duration(self.repeat_interval_seconds),
            "group_by": list(self.group_by), "notify_from_all_ranks": self.notify_from_all_ranks,
            "queue_size": self.queue_size, "runbook_base_url": self.runbook_base_url,
            "grafana_url": self.grafana_url,
            "notifiers": [n.to_dict() for n in self.notifiers],
            "inhibit_rules": [i.to_dict() for i in self.inhibit_rules],
            "silences": [s.to_dict() for s in self.silences],
            "rules": {r.name: r.to_dict() for r in self.rules},
        }


ConfigSource = Union[Mapping[str, Any], str, Path, None]


def near_alerts_key(key: Any) -> bool:
    """Whether top-level ``key`` looks like a typo of ``alerts`` (``alert``, ``alerst``; difflib ratio >= 0.6)."""
    import difflib

    return key != "alerts" and bool(difflib.get_close_matches(str(key), ["alerts"], n=1, cutoff=0.6))


def read_document(source: ConfigSource) -> Dict[str, Any]:
    """The user's alert mapping from a dict, a YAML path, or ``None`` (empty).

    A file whose top level has an ``alerts:`` key (an agent config) yields that key's mapping.
    """
    if source is None:
        return {}
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise AlertConfigError(f"alerts config: cannot read {path} ({type(exc).__name__})") from None
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise AlertConfigError(f"alerts config {path}: not valid YAML ({exc})") from None
        doc = require_mapping(doc, f"alerts config {path}")
        for key in doc:
            if "alerts" not in doc and key not in TOP_KEYS and near_alerts_key(key):
                raise AlertConfigError(f"{path}: unknown top-level key {key!r} (did you mean 'alerts'?); an agent "
                                       "config holds its alert rules under `alerts:`")
        if "alerts" in doc:
            inner = doc["alerts"]
            if isinstance(inner, (str, Path)):
                return read_document(path.parent / Path(inner).expanduser())
            if inner in (None, True):
                return {}
            return dict(require_mapping(inner, f"{path}: alerts"))
        return dict(doc)
    return dict(require_mapping(source, "alerts config"))


def load_config(source: ConfigSource = None) -> AlertConfig:
    """Validate ``source`` (dict, YAML path, or ``None`` for the defaults) merged onto the shipped defaults.

    Raises :class:`AlertConfigError` (a ``ValueError``) naming the field, the
    accepted values, or the nearest valid key for an unknown key.
    """
    user = read_document(source)
    check_keys(user, TOP_KEYS, "alerts")
    defaults = load_default_document()
    doc = {**defaults, **{k: v for k, v in user.items() if k != "rules"}}
    use_defaults = as_bool(user.get("use_default_rules", True), "alerts.use_default_rules")
    runbook_base_url = doc["runbook_base_url"]
    if not isinstance(runbook_base_url, str) or not runbook_base_url:
        raise AlertConfigError("runbook_base_url: expected a URL (the folder that holds <alertname>.md)")
    check_url(runbook_base_url, "runbook_base_url")
    grafana_url = doc["grafana_url"] or ""
    if not isinstance(grafana_url, str):
        raise AlertConfigError("grafana_url: expected a URL such as http://localhost:3000, or '' for no links")
    if grafana_url:
        check_url(grafana_url, "grafana_url")
    rules = merge_rules(defaults["rules"], user.get("rules") or {}, use_defaults=use_defaults,
                        runbook_base_url=runbook_base_url)
    queue_size = as_number(doc["queue_size"], "queue_size", minimum=1, integer=True)
    evaluation = parse_duration(doc["evaluation_interval"], "evaluation_interval")
    watchdog = parse_duration(doc["watchdog_interval"], "watchdog_interval")
    for key, v, floor in (("evaluation_interval", evaluation, MIN_EVALUATION_INTERVAL),
                          ("watchdog_interval", watchdog, MIN_WATCHDOG_INTERVAL)):
        if v < floor:
            raise AlertConfigError(f"{key}: must be at least {format_duration(floor)} (each evaluation takes the "
                                   f"GIL from the training loop), got {doc[key]!r}")
    repeat = parse_duration(doc["repeat_interval"], "repeat_interval")
    if repeat < MIN_REPEAT_INTERVAL:
        raise AlertConfigError(f"repeat_interval: must be at least {format_duration(MIN_REPEAT_INTERVAL)} (0 would "
                               f"re-send every firing group at every evaluation), got {doc['repeat_interval']!r}")
    notifiers_doc = doc["notifiers"] if doc["notifiers"] is not None else []
    if not isinstance(notifiers_doc, list):
        raise AlertConfigError("notifiers: expected a list of notifiers, e.g. [{type: slack, url_env: ...}]")
    notifiers = tuple(parse_notifier(n, f"notifiers[{i}]", queue_size) for i, n in enumerate(notifiers_doc))
    names = [n.name for n in notifiers]
    for n in names:
        if names.count(n) > 1:
            raise AlertConfigError(f"notifiers: two notifiers are called {n!r}; give each a distinct 'name'")
    return AlertConfig(
        evaluation_interval_seconds=evaluation, watchdog_interval_seconds=watchdog,
        repeat_interval_seconds=repeat,
        group_by=as_str_list(doc["group_by"], "group_by"),
        notify_from_all_ranks=as_bool(doc["notify_from_all_ranks"], "notify_from_all_ranks"),
        queue_size=queue_size, runbook_base_url=runbook_base_url, grafana_url=grafana_url, rules=rules,
        notifiers=notifiers, inhibit_rules=parse_inhibit_rules(doc["inhibit_rules"]),
        silences=parse_silences(doc["silences"]),
    )


#: Floors (seconds): below them the engine would spin (evaluation), or re-send a group at every evaluation.
MIN_EVALUATION_INTERVAL = 0.1
MIN_WATCHDOG_INTERVAL = 0.05
MIN_REPEAT_INTERVAL = 60.0
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _max_retries(value: Any, where: str) -> Optional[int]:
    """``None``/``unlimited`` (retry until delivered or superseded) or an integer >= 0."""
    if value is None or value == "unlimited":
        return None
    return as_number(value, where, minimum=0, integer=True)


def parse_notifier(spec: Any, where: str, default_queue_size: int) -> NotifierConfig:
    """Validate one ``notifiers[i]`` entry."""
    spec = require_mapping(spec, where)
    if "url" in spec or "token" in spec:
        key = "url" if "url" in spec else "token"
        raise AlertConfigError(f"{where}.{key}: secrets are not written in the config; use {key}_env (an "
                               f"environment variable) or {key}_file (a file holding it)")
    check_keys(spec, NOTIFIER_KEYS, where)
    kind = spec.get("type")
    if kind not in NOTIFIER_TYPES:
        raise AlertConfigError(f"{where}.type: {kind!r} is not accepted; accepted: {', '.join(NOTIFIER_TYPES)}")
    name = spec.get("name", kind)
    if not isinstance(name, str) or not name or len(name) > 40 or not name.replace("-", "_").isidentifier():
        raise AlertConfigError(f"{where}.name: expected a short name of letters, digits, '-' or '_', got {name!r}")
    if kind == "console":
        for k in _HTTP_ONLY + ("token_env", "token_file"):
            if k in spec:
                raise AlertConfigError(f"{where}.{k}: a console notifier takes no {k}")
    else:
        if bool(spec.get("url_env")) == bool(spec.get("url_file")):
            raise AlertConfigError(f"{where}: a {kind} notifier needs exactly one of url_env (environment "
                                   "variable holding the URL) or url_file (file holding it)")
        if spec.get("token_env") and spec.get("token_file"):
            raise AlertConfigError(f"{where}: give token_env or token_file, not both")
        if kind == "slack" and (spec.get("token_env") or spec.get("token_file")):
            raise AlertConfigError(f"{where}: a Slack incoming webhook takes no token; its URL is the secret")
        if "stream" in spec:
            raise AlertConfigError(f"{where}.stream: only a console notifier takes a stream")
    for k in ("url_env", "url_file", "token_env", "token_file"):
        if k in spec and (not isinstance(spec[k], str) or not spec[k]):
            raise AlertConfigError(f"{where}.{k}: expected a non-empty string")
    for k in ("url_env", "token_env"):
        if k in spec and not _ENV_NAME.match(spec[k]):
            # most likely the secret itself pasted in place of the variable's name: never echo it
            raise AlertConfigError(f"{where}.{k}: expected the NAME of an environment variable (letters, digits, "
                                   "'_'), got something else (not shown: it may be the secret itself); put the "
                                   f"value in the environment and write its name here")
    timeout = parse_duration(spec.get("timeout", 5.0), f"{where}.timeout")
    if timeout <= 0:
        raise AlertConfigError(f"{where}.timeout: must be > 0 (a request without a timeout can hang forever)")
    stream = spec.get("stream", "stderr")
    if stream not in STREAMS:
        raise AlertConfigError(f"{where}.stream: {stream!r} is not accepted; accepted: {', '.join(STREAMS)}")
    return NotifierConfig(
        type=kind, name=name, url_env=spec.get("url_env"), url_file=spec.get("url_file"),
        token_env=spec.get("token_env"), token_file=spec.get("token_file"),
        timeout_seconds=timeout,
        max_retries=_max_retries(spec.get("max_retries"), f"{where}.max_retries"),
        backoff_seconds=parse_duration(spec.get("backoff", 0.5), f"{where}.backoff"),
        max_backoff_seconds=parse_duration(spec.get("max_backoff", 30.0), f"{where}.max_backoff"),
        queue_size=as_number(spec.get("queue_size", default_queue_size), f"{where}.queue_size", minimum=1,
                             integer=True),
        send_resolved=as_bool(spec.get("send_resolved", True), f"{where}.send_resolved"),
        severities=as_str_list(spec.get("severities", list(SEVERITIES)), f"{where}.severities", choices=SEVERITIES),
        stream=stream,
    )
