"""What the framework callbacks share: building the agent, counting a batch's tokens, patching kernels.

The Hugging Face and Lightning callbacks differ only in where they learn the
facts (rank, dtype, model, step boundaries); the rules live here:

* **configuration** — the user's config (path, mapping, :class:`AgentConfig`,
  or ``$MFUWATCH_CONFIG``) and keyword overrides win; facts the framework knows
  (rank, world size, training dtype, run name) only fill keys the user left unset;
* **tokens** — a batch of token ids of shape (B, T) is B x T tokens, padding
  included: padded positions go through every matmul, so B x T is what MFU's
  FLOPs are computed over (counting ``attention_mask.sum()`` would need a
  host-device sync per micro-batch and would understate the work done);
* **gaps** — evaluation and checkpointing between optimizer steps are not
  training; the callbacks ask the agent to leave that time out of the next step
  (``Agent.mark_gap`` where the agent has it);
* **kernels** — ``mfuwatch.kernels.patch(model, **options)`` before the
  optimizer is built, with a check that no parameter escaped the optimizer.

Nothing here imports a training framework.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Mapping, Union

log = logging.getLogger("mfuwatch")

ConfigLike = Union[None, str, os.PathLike, Mapping[str, Any], Any]

#: Agent config keys a framework may fill in when the user did not set them.
FRAMEWORK_KEYS = ("run", "rank", "local_rank", "world_size", "dtype", "model_shape")


def build_config(config: ConfigLike, overrides: Mapping[str, Any], framework: Mapping[str, Any]) -> Any:
    """A validated ``AgentConfig``: framework facts < user config < keyword overrides.

    ``framework`` values that are ``None`` are ignored. Raises ``ConfigError``
    (fail fast, naming the field) for a bad setting.
    """
    from ..config import load_config, user_settings

    user = user_settings(config)
    merged: Dict[str, Any] = {k: v for k, v in framework.items() if v is not None and k not in user}
    merged.update(user)
    return load_config(merged, **overrides)  # an empty run gets the config's default run name


def tokens_in_batch(batch: Any) -> int:
    """Tokens in one micro-batch as a data loader yields it; 0 when the batch holds no tensor.

    ``dict``-like batches are read by key (``input_ids``, ``inputs_embeds``, ...),
    tuples and lists by their first tensor, a tensor as itself; the counting rule
    is :func:`mfuwatch.agent.core.count_tokens` (B x T for (B, T) ids or (B, T, C)
    embeddings; the first dimension otherwise). Reads shapes only: no device sync.
    """
    from ..core import count_tokens

    if isinstance(batch, Mapping):
        n, _ = count_tokens((), dict(batch))
    elif isinstance(batch, (tuple, list)):
        n, _ = count_tokens(tuple(batch), {})
    else:
        n, _ = count_tokens((batch,), {})
    return int(n)


def _call_phase(agent: Any, method: str, name: str) -> None:
    """``agent.<method>(name)`` if the agent has it; a failure is counted (``integration``), never raised."""
    fn = getattr(agent, method, None)
    if fn is None:
        return
    try:
        fn(name)
    except Exception as exc:  # noqa: BLE001
        errors = getattr(agent, "errors", None)
        if errors is not None:
            errors.count("integration", exc)


def begin_phase(agent: Any, name: str) -> None:
    """Open ``agent.phase(name)`` from a framework callback (agents without phases: nothing). Never raises."""
    _call_phase(agent, "begin_phase", name)


def end_phase(agent: Any, name: str) -> None:
    """Close phase ``name`` if it is the innermost open one. Never raises."""
    _call_phase(agent, "end_phase", name)


def open_phase(agent: Any) -> Any:
    """The innermost open phase of ``agent`` (``None`` when none, or for agents without phases)."""
    fleet = getattr(agent, "fleet", None)
    try:
        return fleet.open_phase() if fleet is not None else None
    except Exception:  # noqa: BLE001
        return None


def mark_gap(agent: Any) -> None:
    """Tell ``agent`` that the time since its last step boundary was not training (eval, checkpoint).

    Uses ``agent.mark_gap()`` when the agent has it; older agents count the gap
    into the next step (MFU dips at that step). Never raises.
    """
    fn = getattr(agent, "mark_gap", None)
    if fn is None:
        return
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        errors = getattr(agent, "errors", None)
        if errors is not None:
            errors.count("integration", exc)


def apply_kernel_patch(model: Any, options: Union[bool, Mapping[str, Any]], optimizer: Any = None) -> Any:
    """Run ``mfuwatch.kernels.patch(model, **options)``; return its report, or ``None`` if it failed.

    ``options`` is ``True`` (defaults) or a mapping of ``patch`` keyword
    arguments. A failure (no Triton on this platform, an unsupported module) is
    logged once and training continues with the original modules. When an
    ``optimizer`` already exists, a patch that created parameters the optimizer
    does not hold is reported as an error in the log: those weights would not train.
    """
    kwargs = dict(options) if isinstance(options, Mapping) else {}
    try:
        from mfuwatch.kernels import patch
    except ImportError as exc:
        log.warning("mfuwatch: patch_kernels requested but mfuwatch.kernels.patch is unavailable (%s); "
                    "training continues with the original modules", exc)
        return None
    try:
        report = patch(model, **kwargs)
    except Exception as exc:  # noqa: BLE001 - an optional speed-up must not stop the job
        log.warning("mfuwatch: mfuwatch.kernels.patch failed (%s: %s); training continues with the original "
                    "modules", type(exc).__name__, exc, exc_info=exc)
        return None
    if optimizer is not None:
        held = {id(p) for g in getattr(optimizer, "param_groups", ()) for p in g["params"]}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
        if held and missing:
            log.error("mfuwatch: after mfuwatch.kernels.patch the optimizer does not hold %d parameter(s) (e.g. %s); "
                      "they will not train. Apply the patch before the optimizer is created (for the Trainer: pass "
                      "the callback in Trainer(callbacks=[...]) so it patches at init).", len(missing), missing[0])
    log.info("mfuwatch: kernels patched: %s", getattr(report, "swapped", report))
    return report


def close_quietly(agent: Any, target: Any = None) -> None:
    """Close ``agent`` and remove its file-SD ``target``; never raises (used from framework hooks)."""
    for obj, meth in ((target, "remove"), (agent, "close")):
        if obj is None:
            continue
        try:
            getattr(obj, meth)()
        except Exception as exc:  # noqa: BLE001
            log.warning("mfuwatch: %s.%s() failed: %s", type(obj).__name__, meth, exc)


def adopt_architecture(agent: Any, arch: Any) -> None:
    """Hand ``agent``'s FLOP model an architecture read before the framework wrapped the model (FSDP, a
    strategy); when it is taken, the new FLOP source goes out in an updated ``run`` record."""
    if agent.flop_model.adopt(arch):
        agent.run_info.flops_source = agent.flop_model.source
        agent.reporter.facts_changed()
