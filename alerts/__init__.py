"""mfuwatch.alerts: on-call alerting from the agent's measurements, in-process or through Prometheus.

One YAML rule set (defaults shipped in ``data/default_rules.yaml``) drives two paths:

* :class:`AlertEngine` — evaluates the rules inside the training process and
  notifies Slack, an Alertmanager-format webhook, or the console, from rank 0;
* :func:`render_prometheus` — the equivalent Prometheus alerting rules for teams
  with Prometheus + Alertmanager (``mfuwatch alerts render-prometheus``).

Usage::

    from mfuwatch.alerts import AlertEngine
    engine = AlertEngine.from_config("alerts.yaml", run_info=run_info, registry=registry)
    engine.start()
    engine.observe_step(step)      # StepMeasurement; also observe_window / observe_gpu
    engine.close()

This package imports only :mod:`mfuwatch.agent.schema` from the agent, and never torch.
"""

from __future__ import annotations

from .config import AlertConfig, NotifierConfig, load_config
from .engine import AlertEngine
from .prometheus import render_prometheus
from .validation import AlertConfigError

__all__ = ["AlertEngine", "AlertConfig", "AlertConfigError", "NotifierConfig", "load_config", "render_prometheus"]
