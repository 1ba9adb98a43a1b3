"""mfuwatch.agent: the in-process agent that measures MFU, HFU, tokens/s and the memory-bound share.

Usage::

    from mfuwatch.agent import watch
    agent = watch(model, optimizer)           # exporter on 127.0.0.1:9478 + LOCAL_RANK
    for batch in loader:
        loss = model(batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
    agent.close()

Heavy modules (torch) load on first use of :class:`Agent`, so the data contract
(:mod:`mfuwatch.agent.schema`) and the command line stay fast to import.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Agent", "watch", "AgentConfig", "ConfigError"]


def __getattr__(name: str) -> Any:  # PEP 562: import torch only when the agent is used
    if name in ("Agent", "watch"):
        from . import core

        return getattr(core, name)
    if name in ("AgentConfig", "ConfigError"):
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module 'mfuwatch.agent' has no attribute {name!r}")
