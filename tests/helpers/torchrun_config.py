"""The agent config the torchrun integration tests share: one always-true rule paging through a webhook."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml


def write_observed_config(path: Path, severity: str, cooldown: Optional[str] = None) -> Path:
    """Write an agent config to ``path``: a report every 5 steps, a fixed peak of 1e13 FLOP/s (a CPU
    calibration taken while the other rank computes can be too low), and one rule ``TrainingObserved``
    (``mfu > 0`` for 0 s, of ``severity``; ``cooldown`` when given) sent to the webhook named by
    ``$MFUWATCH_TEST_WEBHOOK_URL`` without retries. Returns ``path``."""
    rule = {"expr": "mfu", "op": ">", "threshold": 0, "for": "0s", "severity": severity,
            "annotations": {"summary": "rank {labels.rank} reports MFU {value:pct}"}}
    if cooldown is not None:
        rule["cooldown"] = cooldown
    path.write_text(yaml.safe_dump({
        "report_every_steps": 5,
        "peak_flops": 1.0e13,
        "alerts": {
            "evaluation_interval": "1s",
            "use_default_rules": False,
            "notifiers": [{"type": "webhook", "url_env": "MFUWATCH_TEST_WEBHOOK_URL", "max_retries": 0}],
            "rules": {"TrainingObserved": rule},
        },
    }))
    return path
