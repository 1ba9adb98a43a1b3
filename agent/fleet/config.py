"""Validation of the agent's fleet settings (``job``, hang watchdog, goodput): called by ``config._validate``.

Kept apart from :mod:`mfuwatch.agent.config` so the fleet settings travel with
the fleet code. Each error names the field and the accepted values.
"""

from __future__ import annotations

import math
from typing import Any, Type


def validate_fleet(cfg: Any, error: Type[Exception]) -> None:
    """Check and normalise the fleet fields of an ``AgentConfig`` in place.

    Raises:
        error: (the config module's ``ConfigError``) naming the field and the accepted values.
    """
    if not isinstance(cfg.job, str):
        raise error(f"job: expected a string (the `job` label; empty = from the environment), got {cfg.job!r}")
    for name in ("hang_watchdog", "auto_checkpoint_phases"):
        v = getattr(cfg, name)
        if not isinstance(v, bool):
            raise error(f"{name}: expected true or false, got {v!r}")
    for name, lo in (("hang_factor", 1.0), ("hang_floor_seconds", 0.0)):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v > lo:
            raise error(f"{name}: expected a finite number > {lo:g}, got {v!r}")
        setattr(cfg, name, float(v))
    ep = cfg.otlp_endpoint
    if ep is not None and (not isinstance(ep, str) or not ep.startswith(("http://", "https://"))):
        raise error(f"otlp_endpoint: expected an http(s):// URL of an OTLP/HTTP metrics receiver or null, got {ep!r}")
    v = cfg.goodput_warmup_steps
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise error(f"goodput_warmup_steps: expected an integer >= 0, got {v!r}")
