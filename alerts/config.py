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

import dataclasses
import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import yaml

from .matchers import InhibitRule, Silence, parse_inhibit_rules, parse_silences
from .routing import Route, parse_routes
from .rules import SEVERITIES, Rule, load_default_document, merge_rules
from .validation import (AlertConfigError, as_bool, as_number, as_str_list, check_keys, check_url,
                         format_duration, parse_duration, require_mapping)

__all__ = ["AlertConfig", "NotifierConfig", "AlertConfigError", "load_config", "TOP_KEYS", "NOTIFIER_TYPES"]

TOP_KEYS = ("evaluation_interval", "watchdog_interval", "repeat_interval", "group_by", "notify_from_all_ranks",
            "queue_size", "runbook_base_url", "grafana_url", "notifiers", "routes", "inhibit_rules", "silences",
            "rules", "use_default_rules")
NOTIFIER_TYPES = ("console", "slack", "webhook", "pagerduty", "opsgenie", "teams", "discord", "email")
_COMMON_KEYS = ("type", "name", "queue_size", "send_resolved", "severities")
_RETRY_KEYS = ("timeout", "max_retries", "backoff", "max_backoff")
_URL_KEYS = ("url_env", "url_file")
#: The keys each notifier type accepts (besides :data:`_COMMON_KEYS`).
TYPE_KEYS: Dict[str, Tuple[str, ...]] = {
    "console": ("stream",),
    "slack": _RETRY_KEYS + _URL_KEYS,
    "webhook": _RETRY_KEYS + _URL_KEYS + ("token_env", "token_file"),
    "teams": _RETRY_KEYS + _URL_KEYS + ("api_url",),
    "discord": _RETRY_KEYS + _URL_KEYS + ("api_url",),
    "pagerduty": _RETRY_KEYS + ("routing_key_env", "routing_key_file", "api_url", "severity_map"),
    "opsgenie": _RETRY_KEYS + ("api_key_env", "api_key_file", "api_url", "region", "severity_map"),
    "email": _RETRY_KEYS + ("smtp_host", "smtp_port", "tls", "from", "to", "username_env", "username_file",
                            "password_env", "password_file", "ca_file"),
}
NOTIFIER_KEYS = tuple(dict.fromkeys(_COMMON_KEYS + sum(TYPE_KEYS.values(), ())))
#: Secrets each type reads: (name, required). ``name_env`` / ``name_file`` say where it is.
TYPE_SECRETS: Dict[str, Tuple[Tuple[str, bool], ...]] = {
    "console": (), "slack": (("url", True),), "webhook": (("url", True), ("token", False)),
    "teams": (("url", True),), "discord": (("url", True),), "pagerduty": (("routing_key", True),),
    "opsgenie": (("api_key", True),), "email": (("username", False), ("password", False)),
}
STREAMS = ("stderr", "stdout", "log")
OPSGENIE_REGIONS = ("us", "eu")
EMAIL_TLS = ("starttls", "tls", "none")
#: What ``severity_map`` may map mfuwatch's severities to, per type (the vendor's documented values).
SEVERITY_TARGETS = {"pagerduty": ("critical", "error", "warning", "info"),
                    "opsgenie": ("P1", "P2", "P3", "P4", "P5")}


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
    #: A vendor endpoint instead of the documented one (proxy, regional endpoint, test server).
    api_url: Optional[str] = None
    routing_key_env: Optional[str] = None  # PagerDuty
    routing_key_file: Optional[str] = None
    api_key_env: Optional[str] = None  # Opsgenie
    api_key_file: Optional[str] = None
    region: str = "us"  # Opsgenie: us | eu
    severity_map: Tuple[Tuple[str, str], ...] = ()  # PagerDuty / Opsgenie: mfuwatch severity -> vendor value
    smtp_host: str = ""  # email
    smtp_port: int = 0  # 0: 587 with STARTTLS, 465 with implicit TLS, 25 without TLS
    tls: str = "starttls"
    sender: str = ""  # the config's `from`
    to: Tuple[str, ...] = ()
    username_env: Optional[str] = None
    username_file: Optional[str] = None
    password_env: Optional[str] = None
    password_file: Optional[str] = None
    ca_file: Optional[str] = None
    #: The alert config's ``routes`` (set by :func:`load_config`): the notifier keeps only alerts routed to it.
    routes: Tuple[Any, ...] = ()

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"type": self.type, "name": self.name}
        for k in ("url_env", "url_file", "token_env", "token_file", "routing_key_env", "routing_key_file",
                  "api_key_env", "api_key_file", "username_env", "username_file", "password_env", "password_file",
                  "api_url", "ca_file"):
            if getattr(self, k):
                d[k] = getattr(self, k)
        if self.type == "opsgenie":
            d["region"] = self.region
        if self.severity_map:
            d["severity_map"] = dict(self.severity_map)
        if self.type == "email":
            d.update(smtp_host=self.smtp_host, smtp_port=self.smtp_port, tls=self.tls, **{"from": self.sender},
                     to=list(self.to))
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
    routes: Tuple[Route, ...] = ()

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
            **({"routes": [r.to_dict() for r in self.routes]} if self.routes else {}),
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
    routes = parse_routes(doc.get("routes"), names, rules)
    if routes:
        notifiers = tuple(dataclasses.replace(n, routes=routes) for n in notifiers)
    return AlertConfig(
        evaluation_interval_seconds=evaluation, watchdog_interval_seconds=watchdog,
        repeat_interval_seconds=repeat,
        group_by=as_str_list(doc["group_by"], "group_by"),
        notify_from_all_ranks=as_bool(doc["notify_from_all_ranks"], "notify_from_all_ranks"),
        queue_size=queue_size, runbook_base_url=runbook_base_url, grafana_url=grafana_url, rules=rules,
        notifiers=notifiers, inhibit_rules=parse_inhibit_rules(doc["inhibit_rules"]),
        silences=parse_silences(doc["silences"]), routes=routes,
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


def _secret_refs(spec: Mapping[str, Any], kind: str, where: str) -> Dict[str, Optional[str]]:
    """Validate the ``<secret>_env`` / ``<secret>_file`` pairs of a ``kind`` notifier; returns them by key."""
    out: Dict[str, Optional[str]] = {}
    for secret, required in TYPE_SECRETS[kind]:
        env, file = spec.get(f"{secret}_env"), spec.get(f"{secret}_file")
        if env and file:
            raise AlertConfigError(f"{where}: give {secret}_env or {secret}_file, not both")
        if required and not (env or file):
            what = "URL" if secret == "url" else secret.replace("_", " ")
            raise AlertConfigError(f"{where}: a {kind} notifier needs exactly one of {secret}_env (environment "
                                   f"variable holding the {what}) or {secret}_file (file holding it)")
        out[f"{secret}_env"], out[f"{secret}_file"] = env, file
    for k, v in out.items():
        if k in spec and (not isinstance(v, str) or not v):
            raise AlertConfigError(f"{where}.{k}: expected a non-empty string")
        if k.endswith("_env") and v and not _ENV_NAME.match(v):
            # most likely the secret itself pasted in place of the variable's name: never echo it
            raise AlertConfigError(f"{where}.{k}: expected the NAME of an environment variable (letters, digits, "
                                   "'_'), got something else (not shown: it may be the secret itself); put the "
                                   f"value in the environment and write its name here")
    return out


def _severity_map(value: Any, kind: str, where: str) -> Tuple[Tuple[str, str], ...]:
    mapping = require_mapping(value, where)
    targets = SEVERITY_TARGETS[kind]
    for k, v in mapping.items():
        as_str_list([k], where, choices=SEVERITIES)
        as_str_list([v], f"{where}.{k}", choices=targets)
    return tuple((str(k), str(v)) for k, v in mapping.items())


def _email_fields(spec: Mapping[str, Any], where: str) -> Dict[str, Any]:
    host = spec.get("smtp_host")
    if not isinstance(host, str) or not host:
        raise AlertConfigError(f"{where}.smtp_host: an email notifier needs the SMTP server's host name")
    tls = spec.get("tls", "starttls")
    if tls not in EMAIL_TLS:
        raise AlertConfigError(f"{where}.tls: {tls!r} is not accepted; accepted: {', '.join(EMAIL_TLS)} "
                               "(starttls: port 587, tls: implicit TLS on port 465)")
    port = as_number(spec.get("smtp_port", 0), f"{where}.smtp_port", minimum=0, integer=True)
    if port > 65535:
        raise AlertConfigError(f"{where}.smtp_port: must be a port number in 1..65535, got {port}")
    sender = spec.get("from")
    to = as_str_list(spec.get("to", []), f"{where}.to")
    for addr, key in [(sender, "from")] + [(t, "to") for t in to]:
        if not isinstance(addr, str) or not re.match(r"^[^@\s<>]+@[^@\s<>]+$", addr):
            raise AlertConfigError(f"{where}.{key}: expected an e-mail address such as oncall@example.org, "
                                   f"got {addr!r}")
    if not to:
        raise AlertConfigError(f"{where}.to: an email notifier needs at least one recipient")
    if tls == "none" and (spec.get("password_env") or spec.get("password_file")) \
            and host not in ("localhost", "127.0.0.1", "::1"):
        raise AlertConfigError(f"{where}.tls: 'none' would send the SMTP password in clear text to {host}; use "
                               "starttls or tls")
    if bool(spec.get("username_env") or spec.get("username_file")) != \
            bool(spec.get("password_env") or spec.get("password_file")):
        raise AlertConfigError(f"{where}: SMTP authentication needs both a username (username_env/_file) and a "
                               "password (password_env/_file), or neither")
    ca = spec.get("ca_file")
    if ca is not None and (not isinstance(ca, str) or not ca):
        raise AlertConfigError(f"{where}.ca_file: expected the path of a PEM file of CA certificates")
    return dict(smtp_host=host, smtp_port=int(port), tls=tls, sender=sender, to=to, ca_file=ca)


def parse_notifier(spec: Any, where: str, default_queue_size: int) -> NotifierConfig:
    """Validate one ``notifiers[i]`` entry: the keys its ``type`` accepts (:data:`TYPE_KEYS`), secrets by
    reference only (``*_env``/``*_file``), durations, and the type's own fields."""
    spec = require_mapping(spec, where)
    for key in ("url", "token", "routing_key", "api_key", "password", "username"):
        if key in spec:
            raise AlertConfigError(f"{where}.{key}: secrets are not written in the config; use {key}_env (an "
                                   f"environment variable) or {key}_file (a file holding it)")
    kind = spec.get("type")
    if kind in NOTIFIER_TYPES:  # an unknown key: the nearest and the list from this type's own keys
        own = _COMMON_KEYS + TYPE_KEYS[kind]
        check_keys({k: v for k, v in spec.items() if k not in NOTIFIER_KEYS or k in own}, own, where)
    else:
        check_keys(spec, NOTIFIER_KEYS, where)
    if kind not in NOTIFIER_TYPES:
        near = difflib.get_close_matches(str(kind), NOTIFIER_TYPES, n=1, cutoff=0.5)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise AlertConfigError(f"{where}.type: {kind!r} is not accepted{hint}; accepted: {', '.join(NOTIFIER_TYPES)}")
    allowed = _COMMON_KEYS + TYPE_KEYS[kind]
    for k in spec:
        if k not in allowed:
            if kind == "slack" and k in ("token_env", "token_file"):
                raise AlertConfigError(f"{where}: a Slack incoming webhook takes no token; its URL is the secret")
            if k == "stream":
                raise AlertConfigError(f"{where}.stream: only a console notifier takes a stream")
            raise AlertConfigError(f"{where}.{k}: a {kind} notifier takes no {k}; it accepts "
                                   f"{', '.join(sorted(allowed))}")
    name = spec.get("name", kind)
    if not isinstance(name, str) or not name or len(name) > 40 or not name.replace("-", "_").isidentifier():
        raise AlertConfigError(f"{where}.name: expected a short name of letters, digits, '-' or '_', got {name!r}")
    secrets = _secret_refs(spec, kind, where)
    timeout = parse_duration(spec.get("timeout", 5.0 if kind != "email" else 10.0), f"{where}.timeout")
    if timeout <= 0:
        raise AlertConfigError(f"{where}.timeout: must be > 0 (a request without a timeout can hang forever)")
    stream = spec.get("stream", "stderr")
    if stream not in STREAMS:
        raise AlertConfigError(f"{where}.stream: {stream!r} is not accepted; accepted: {', '.join(STREAMS)}")
    extra: Dict[str, Any] = {}
    if "api_url" in spec:
        if not isinstance(spec["api_url"], str):
            raise AlertConfigError(f"{where}.api_url: expected a URL such as https://events.eu.pagerduty.com")
        extra["api_url"] = check_url(spec["api_url"], f"{where}.api_url")
    if kind == "opsgenie":
        region = spec.get("region", "us")
        if region not in OPSGENIE_REGIONS:
            raise AlertConfigError(f"{where}.region: {region!r} is not accepted; accepted: us "
                                   "(api.opsgenie.com), eu (api.eu.opsgenie.com)")
        extra["region"] = region
    if "severity_map" in spec:
        extra["severity_map"] = _severity_map(spec["severity_map"], kind, f"{where}.severity_map")
    if kind == "email":
        extra.update(_email_fields(spec, where))
    return NotifierConfig(
        type=kind, name=name, **secrets,
        timeout_seconds=timeout,
        max_retries=_max_retries(spec.get("max_retries"), f"{where}.max_retries"),
        backoff_seconds=parse_duration(spec.get("backoff", 0.5), f"{where}.backoff"),
        max_backoff_seconds=parse_duration(spec.get("max_backoff", 30.0), f"{where}.max_backoff"),
        queue_size=as_number(spec.get("queue_size", default_queue_size), f"{where}.queue_size", minimum=1,
                             integer=True),
        send_resolved=as_bool(spec.get("send_resolved", True), f"{where}.send_resolved"),
        severities=as_str_list(spec.get("severities", list(SEVERITIES)), f"{where}.severities", choices=SEVERITIES),
        stream=stream, **extra,
    )
