"""Framework glue for the mfuwatch agent; each module imports its framework only when it is imported itself.

* :mod:`mfuwatch.agent.integrations.hf` — ``MFUWatchCallback`` for the Hugging Face ``Trainer``
  (``pip install 'mfuwatch[hf]'``);
* :mod:`mfuwatch.agent.integrations.lightning` — ``MFUWatchCallback`` for Lightning
  (``pip install 'mfuwatch[lightning]'``).

Rank identity, the shared run name and Prometheus discovery for torchrun / DDP / FSDP jobs are not
framework glue: they live in :mod:`mfuwatch.agent.distributed`. This package module imports
nothing, so ``import mfuwatch.agent`` never pulls in transformers or lightning.
"""
