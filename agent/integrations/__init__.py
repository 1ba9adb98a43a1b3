"""Framework glue for the mfuwatch agent; each module imports its framework only when it is imported itself.

* :mod:`mfuwatch.agent.integrations.distributed` — torchrun / DDP / FSDP: rank identity, a run name shared
  by all ranks, Prometheus file-based service discovery and scrape configs (standard library only);
* :mod:`mfuwatch.agent.integrations.hf` — ``MFUWatchCallback`` for the Hugging Face ``Trainer``
  (``pip install 'mfuwatch[hf]'``);
* :mod:`mfuwatch.agent.integrations.lightning` — ``MFUWatchCallback`` for Lightning
  (``pip install 'mfuwatch[lightning]'``).

This package module imports nothing, so ``import mfuwatch.agent`` never pulls in transformers or lightning.
"""
