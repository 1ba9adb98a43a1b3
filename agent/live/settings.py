"""Validation of the agent's exporter-hardening and preemption settings: called by ``config._validate``.

Fields (on :class:`~mfuwatch.agent.config.AgentConfig`):

``exporter_auth``                    ``null``, or ``{type: bearer, token_env: VAR | token_file: PATH}``, or
                                     ``{type: basic, username: NAME, password_env: VAR | password_file: PATH}``
                                     (what Prometheus sends with ``authorization`` / ``basic_auth``)
``exporter_max_connections``         open connections at most (1..65536)
``exporter_read_timeout_seconds``    a request must arrive (and its answer be taken) within this (> 0)
``tls_handshake_timeout_seconds``    a TLS handshake must end within this (> 0)
``exporter_render_interval_seconds`` the exposition is rendered at most this often (>= 0)
``exporter_max_cpu_share``           the server loop's CPU time per wall second, at most (0 < x <= 1)
``exporter_server``                  where requests are answered: ``process`` (default: a server child process,
                                     :mod:`.server_process`) or ``thread`` (in the training process); accepted:
                                     :data:`EXPORTER_SERVERS`
``exporter_server_cpus``             the CPUs the server child runs on (``exporter_server: process``):
                                     ``null`` (default: the training process's affinity, inherited), a list of
                                     CPU numbers or a string of them and ranges (``"8-11,14"``), each in
                                     ``0..os.cpu_count()-1``; not with ``exporter_server: thread``
``preemption_signals``               signal names that close the agent before their previous handler runs
                                     (``[]`` = none); accepted: :data:`PREEMPTION_SIGNALS`
``preemption_timeout_seconds``       the bound on that close, in (0, :data:`MAX_PREEMPTION_TIMEOUT_SECONDS`]

Secrets are read where the config names them (environment or file), never written in it.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Type

#: signals a scheduler sends before it kills a job: SIGTERM (Slurm at the time limit and on preemption,
#: Kubernetes, torchrun), SIGHUP (a lost terminal, some batch systems), SIGUSR1/SIGUSR2 (Slurm's
#: ``--signal``, LSF, SGE warnings). SIGINT is left to Python's KeyboardInterrupt (the agent closes then).
PREEMPTION_SIGNALS = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
#: the most ``preemption_timeout_seconds`` may be: a close on SIGTERM must end within the scheduler's grace
#: period before its SIGKILL (Slurm ``KillWait`` and Kubernetes ``terminationGracePeriodSeconds`` default to
#: 30 s; 60 leaves room for clusters that raise them), and the signal is handed on only after it
MAX_PREEMPTION_TIMEOUT_SECONDS = 60.0
#: accepted values of ``exporter_server``
EXPORTER_SERVERS = ("process", "thread")

_AUTH_KEYS = {"bearer": {"type", "token_env", "token_file"},
              "basic": {"type", "username", "password_env", "password_file"}}


def _positive(cfg: Any, name: str, error: Type[Exception], zero_ok: bool = False) -> None:
    v = getattr(cfg, name)
    ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and
          (v >= 0 if zero_ok else v > 0))
    if not ok:
        raise error(f"{name}: expected a finite number {'>= 0' if zero_ok else '> 0'} (seconds), got {v!r}")
    setattr(cfg, name, float(v))


def validate_live(cfg: Any, error: Type[Exception]) -> None:
    """Check and normalise the fields listed in the module docstring, in place.

    Raises:
        error: (the config module's ``ConfigError``) naming the field and the accepted values; for
            ``exporter_auth``, also when its secret cannot be read (naming the variable or file only).
    """
    import difflib

    v = cfg.exporter_max_connections
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65536:
        raise error(f"exporter_max_connections: expected an integer 1..65536, got {v!r}")
    for name in ("exporter_read_timeout_seconds", "tls_handshake_timeout_seconds"):
        _positive(cfg, name, error)
    v = cfg.preemption_timeout_seconds
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            or not 0 < v <= MAX_PREEMPTION_TIMEOUT_SECONDS):
        raise error(f"preemption_timeout_seconds: expected a number of seconds in (0, "
                    f"{MAX_PREEMPTION_TIMEOUT_SECONDS:g}] (within the scheduler's grace period before SIGKILL: "
                    f"Slurm KillWait and Kubernetes terminationGracePeriodSeconds default to 30), got {v!r}")
    cfg.preemption_timeout_seconds = float(v)
    _positive(cfg, "exporter_render_interval_seconds", error, zero_ok=True)
    v = cfg.exporter_max_cpu_share
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v <= 1):
        raise error(f"exporter_max_cpu_share: expected a number in (0, 1] (share of one core), got {v!r}")
    cfg.exporter_max_cpu_share = float(v)
    v = cfg.exporter_server
    if not isinstance(v, str) or v.strip().lower() not in EXPORTER_SERVERS:
        raise error(f"exporter_server: expected one of {', '.join(EXPORTER_SERVERS)}, got {v!r}")
    cfg.exporter_server = v.strip().lower()
    cfg.exporter_server_cpus = parse_cpus(cfg.exporter_server_cpus, error)
    if cfg.exporter_server_cpus is not None and cfg.exporter_server == "thread":
        raise error("exporter_server_cpus: applies to the server child only (exporter_server: process); the thread "
                    "server runs inside the training process: remove one of the two")
    sigs = cfg.preemption_signals
    if sigs in (None, False):
        sigs = []
    if isinstance(sigs, str):
        sigs = [s.strip() for s in sigs.split(",") if s.strip()]
    if not isinstance(sigs, (list, tuple)):
        raise error(f"preemption_signals: expected a list of signal names ({', '.join(PREEMPTION_SIGNALS)}) or [], "
                    f"got {sigs!r}")
    out = []
    for s in sigs:
        name = str(s).upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        if name not in PREEMPTION_SIGNALS:
            m = difflib.get_close_matches(name, PREEMPTION_SIGNALS, n=1, cutoff=0.5)
            hint = f" (did you mean {m[0]!r}?)" if m else ""
            raise error(f"preemption_signals: unknown signal {s!r}{hint}; accepted: {', '.join(PREEMPTION_SIGNALS)}")
        if name not in out:
            out.append(name)
    cfg.preemption_signals = out
    cfg.exporter_auth = _validate_auth(cfg.exporter_auth, error)


def parse_cpus(v: Any, error: Type[Exception]) -> Optional[list]:
    """``exporter_server_cpus`` as a sorted list of distinct CPU numbers, or ``None`` (inherit the affinity).

    Accepts ``None``, an int, a list/tuple of ints, or a string of numbers and ``a-b`` ranges separated by
    commas (the ``taskset -c`` / cpuset list format, ``"8-11,14"``). Whether the kernel lets the child use
    them (a cgroup cpuset can forbid some) is known only when the child applies them; a refusal is counted,
    logged once, and the child keeps the inherited affinity.

    Raises:
        error: not of those forms, empty, or a CPU outside ``0..os.cpu_count()-1``.
    """
    import os

    if v is None:
        return None
    accepted = "null, a list of CPU numbers or a string such as '8-11,14'"
    cpus: list = []
    if isinstance(v, str):
        for part in v.split(","):
            part = part.strip()
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            if not lo.strip().isdigit() or (sep and not hi.strip().isdigit()):
                raise error(f"exporter_server_cpus: expected {accepted}, got {v!r}")
            a, b = int(lo), int(hi) if sep else int(lo)
            if b < a:
                raise error(f"exporter_server_cpus: range {part!r} ends before it starts")
            cpus.extend(range(a, b + 1))
    elif isinstance(v, int) and not isinstance(v, bool):
        cpus = [v]
    elif isinstance(v, (list, tuple)) and all(isinstance(c, int) and not isinstance(c, bool) for c in v):
        cpus = list(v)
    else:
        raise error(f"exporter_server_cpus: expected {accepted}, got {v!r}")
    n = os.cpu_count() or 1
    if not cpus:
        raise error(f"exporter_server_cpus: expected {accepted}, got an empty set ({v!r})")
    bad = [c for c in cpus if not 0 <= c < n]
    if bad:
        raise error(f"exporter_server_cpus: CPU {bad[0]} does not exist (this machine has CPUs 0..{n - 1})")
    return sorted(set(cpus))


def _validate_auth(a: Any, error: Type[Exception]) -> Optional[dict]:
    if a in (None, False, {}):
        return None
    if not isinstance(a, dict):
        raise error("exporter_auth: expected null, {type: bearer, token_env|token_file} or "
                    f"{{type: basic, username, password_env|password_file}}, got {a!r}")
    typ = str(a.get("type", "")).lower()
    if typ not in _AUTH_KEYS:
        raise error(f"exporter_auth.type: expected 'bearer' or 'basic', got {a.get('type')!r}")
    for k in a:
        if k not in _AUTH_KEYS[typ]:
            import difflib

            m = difflib.get_close_matches(k, sorted(_AUTH_KEYS[typ]), n=1, cutoff=0.5)
            raise error(f"exporter_auth.{k}: unknown key{f' (did you mean {m[0]!r}?)' if m else ''}; accepted for "
                        f"type {typ}: {', '.join(sorted(_AUTH_KEYS[typ]))}")
    if typ == "basic" and not (isinstance(a.get("username"), str) and a["username"]):
        raise error("exporter_auth.username: required for type basic (a non-empty string)")
    auth_from_config(dict(a, type=typ), error)  # reads the secret now: a missing one fails at start-up
    return dict(a, type=typ)


def auth_from_config(a: Optional[dict], error: Type[Exception] = ValueError) -> Any:
    """The :class:`~mfuwatch.agent.live.http_server.Auth` of a validated ``exporter_auth`` mapping (or ``None``).

    Raises:
        error: the secret's variable is unset/empty or its file unreadable/empty (the message names the
            variable or the path, never the value).
    """
    if not a:
        return None
    from mfuwatch.alerts.secrets import SecretError, resolve_secret

    from .http_server import Auth

    try:
        if a["type"] == "bearer":
            return Auth.bearer(resolve_secret(a.get("token_env"), a.get("token_file"),
                                              "exporter_auth.token").reveal())
        return Auth.basic(a["username"], resolve_secret(a.get("password_env"), a.get("password_file"),
                                                        "exporter_auth.password").reveal())
    except SecretError as exc:
        raise error(str(exc)) from None
