"""Zero-code attach: the agent attaches itself at a job's first optimizer step.

The bootstrap (``boot/sitecustomize.py``) calls :func:`install` once ``torch`` is imported. From
then on:

1. **step 1** — torch's global optimizer step post-hook
   (``torch.optim.optimizer.register_optimizer_step_post_hook``) fires at the end of the first
   optimizer step of the process; the optimizer it names is the one the agent will watch (a
   second optimizer, as in a GAN, is not watched). The hook registers torch's global module
   forward pre-hook and forward hook (``torch.nn.modules.module.register_module_forward_pre_hook``
   / ``register_module_forward_hook(with_kwargs=True)``) for the next forward only;
2. **step 2** — the first module whose forward starts and which holds one of that optimizer's
   parameters is the model: modules are entered parents first, so it is the outermost module of
   the optimizer's parameters that the training loop calls (a frozen teacher or a loss module
   without trainable parameters is passed over; a LightningModule, never called itself, gives way
   to the model its ``training_step`` calls). ``DistributedDataParallel``, ``DataParallel`` and
   FSDP (1) wrappers are unwrapped to the module they run; FSDP2 (``fully_shard``) changes the
   module in place and needs nothing; a ``torch.compile`` wrapper (``OptimizedModule``) is kept as
   it is, since hooks added to the module inside a compiled region are not run by the compiled
   code, while the wrapper's own hooks run eagerly (its ``config`` and modules are the original
   model's). A module compiled in place (``module.compile()``) runs its own hooks inside the compiled
   graph: the agent's forward hooks go around its compiled call (``live.hooks``), and the attach
   forward, already inside the graph, is not the one whose FLOPs are counted. The
   global hooks themselves always run eagerly (``torch.compiler.disable``). An
   :class:`~mfuwatch.agent.core.Agent` is built on that module and optimizer with
   the configuration of ``watch()`` (``$MFUWATCH_CONFIG``, keyword-free), numbered so that its
   first step is the job's step 2: that step is timed from the start of its first forward (as
   ``watch()`` times its step 1), its tokens and FLOPs are those of ``watch()``. The global hooks
   are removed.

The job's step 1 is not measured (its forward ran before the model was known). Nothing here
raises into the training loop: a failure is one warning (``attaching failed``), the hooks are
removed and the job runs unmonitored. A process that never steps an optimizer pays one global
optimizer hook that never runs.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Any, Optional

import torch
from torch import nn

from ..live.hooks import COMPILE_HOOK_WARNING, remove_global_hook

log = logging.getLogger("mfuwatch")

#: the warning torch.compile's wrapper prints while global module hooks exist (ours, for one forward)

_lock = threading.Lock()
_installed: Optional["Attacher"] = None


def install() -> Optional["Attacher"]:
    """Register the first-step hook in this process (idempotent); ``None`` when ``MFUWATCH_DISABLE`` is set.

    Called by the bootstrap right after ``import torch``; callable by hand too (tests). Raises what
    ``register_optimizer_step_post_hook`` raises (torch < 2.0 has none).
    """
    global _installed
    if os.environ.get("MFUWATCH_DISABLE", "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    with _lock:
        if _installed is None:
            a = Attacher()
            a.arm()
            _installed = a
        return _installed


def unwrap(module: nn.Module) -> nn.Module:
    """The module a data-parallel wrapper runs: ``DistributedDataParallel`` / ``DataParallel`` / FSDP (1)
    ``.module``, repeatedly; anything else (a ``torch.compile`` ``OptimizedModule``, an FSDP2 module) as is."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    wrappers: tuple = (DistributedDataParallel, DataParallel)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers += (FullyShardedDataParallel,)
    except Exception:  # noqa: BLE001 - a torch built without distributed
        pass
    m = module
    for _ in range(8):
        inner = getattr(m, "module", None)
        if isinstance(m, wrappers) and isinstance(inner, nn.Module):
            m = inner
        else:
            break
    return m


def _eager(fn: Any) -> Any:
    """``fn`` run eagerly even when called from code ``torch.compile`` traces (the global module hooks run
    inside a module compiled in place with ``module.compile()``): the attacher builds an agent, opens files
    and logs, none of which belongs in a graph. ``fn`` itself where torch has no ``torch.compiler.disable``."""
    try:
        return torch.compiler.disable(fn)
    except Exception:  # noqa: BLE001
        return fn


def _holds_any(module: nn.Module, ids: set) -> bool:
    return any(id(p) in ids for p in module.parameters())


class Attacher:
    """The attach state machine of one process: ``armed`` → ``choosing`` → ``attached`` | ``failed`` | ``skipped``.

    ``agent`` is the :class:`~mfuwatch.agent.core.Agent` once attached; ``model`` the module its hooks
    are on. ``make_agent(model, optimizer)`` builds it (default: ``Agent(model, optimizer)``, the
    configuration of ``watch()``); tests pass one that raises to see a failing attach.
    """

    def __init__(self, make_agent: Any = None) -> None:
        self.state = "armed"
        self.agent: Any = None
        self.model: Optional[nn.Module] = None
        self.optimizer: Any = None
        self.make_agent = make_agent or _default_agent
        self._ids: set = set()
        self._opt_handle: Any = None
        self._pre_handle: Any = None
        self._post_handle: Any = None
        self._filter: Any = None
        self._fed: Optional[nn.Module] = None  # the module whose current forward was fed to the agent by hand
        self._fed_tokens = 0

    # ------------------------------------------------------------------ hooks
    def arm(self) -> None:
        """Register torch's global optimizer step post-hook."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._opt_handle = register_optimizer_step_post_hook(self._after_step)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Global optimizer post-hook: the end of an optimizer step of any optimizer of the process."""
        if self.state == "armed":
            try:
                self._begin_choosing(optimizer)
            except Exception as exc:  # noqa: BLE001
                self.fail(exc)
        elif self.state == "choosing" and optimizer is self.optimizer:
            self.fail(RuntimeError("no forward of a module holding the optimizer's parameters ran between its "
                                   "first two steps (parameters used outside any nn.Module?)"))

    def _begin_choosing(self, optimizer: Any) -> None:
        from .. import core as lifecycle  # the registry of live agents (_live_agents)

        if any(not getattr(a, "_closed", True) for a in list(lifecycle._live_agents)):
            self.state = "skipped"  # the job runs its own agent (watch() or a framework callback)
            log.info("mfuwatch: this process already runs an mfuwatch agent; `mfuwatch run` does not attach another")
            return
        self.optimizer = optimizer
        self._ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not self._ids:
            raise RuntimeError("the first optimizer stepped holds no parameters")
        from torch.nn.modules import module as module_mod

        warnings.filterwarnings("ignore", message=COMPILE_HOOK_WARNING)
        self._filter = warnings.filters[0]
        self._pre_handle = module_mod.register_module_forward_pre_hook(_eager(self._before_forward))
        self._post_handle = module_mod.register_module_forward_hook(_eager(self._after_forward), with_kwargs=True)
        self.state = "choosing"

    def _before_forward(self, module: nn.Module, args: tuple) -> None:
        """Global forward pre-hook while choosing: the first module holding the optimizer's parameters."""
        if self.state != "choosing":
            return
        try:
            if not _holds_any(module, self._ids):
                return
            self._attach(module, args)
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)

    def _attach(self, called: nn.Module, args: tuple) -> None:
        target = unwrap(called)
        self._remove_pre_hook()
        agent = self.make_agent(target, self.optimizer)
        self.agent, self.model, self.state = agent, target, "attached"
        # The job's step 1 is done: this agent's steps carry the job's numbers, and its first step (the
        # job's step 2) is timed from here, the start of its first forward, as watch() times its step 1.
        agent.hooks.step = 1
        agent.hooks._clock_started = True
        agent.clock.start(step=1)
        if target is called:
            # the agent's pre-hook, just registered on this module, misses the forward that is starting:
            # give it this forward (its keyword arguments arrive in the global forward hook)
            before = agent.hooks._pending_tokens
            agent.hooks._pre_forward(called, args, {})
            self._fed = called
            self._fed_tokens = agent.hooks._pending_tokens - before  # counted again with the kwargs, after the forward
            if getattr(called, "_compiled_call_impl", None) is not None:
                # compiled in place: this forward already runs inside the compiled call, where a count
                # misses the backward; the agent's hooks sit around that call from the next forward on,
                # so the FLOPs are counted over the next step instead
                counter = agent.hooks.flop_model.counter
                if counter is not None and counter.active:
                    counter.abort()
        else:
            self._remove_post_hook()  # the wrapped module's own hooks see its forward
        n_held = sum(1 for p in target.parameters() if id(p) in self._ids)
        log.info("mfuwatch: attached to %s (%d of the optimizer's %d parameter tensors) at the job's second "
                 "optimizer step", type(target).__name__, n_held, len(self._ids))

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Global forward hook (with kwargs): the tokens of the hand-fed forward, counted with its kwargs."""
        if module is not self._fed:
            return
        self._fed = None
        self._remove_post_hook()
        try:
            agent = self.agent
            if agent is None or not kwargs or agent.config.tokens_per_step is not None:
                return
            if not torch.is_grad_enabled() or not module.training:
                return
            from ..live.hooks import count_tokens

            n, seq = count_tokens(args, kwargs)
            agent.hooks._pending_tokens += n - self._fed_tokens
            if seq:
                agent.hooks.seq_len = seq
        except Exception as exc:  # noqa: BLE001
            if self.agent is not None:
                self.agent.errors.count("hooks", exc)

    # ---------------------------------------------------------------- failure
    def fail(self, exc: BaseException) -> None:
        """Give up: one warning, global hooks removed, an agent already built closed. Never raises."""
        self.state = "failed"
        self._remove_pre_hook()
        self._remove_post_hook()
        agent, self.agent = self.agent, None
        if agent is not None:
            try:
                agent.close()
            except Exception:  # noqa: BLE001
                pass
        try:
            log.warning("mfuwatch: attaching failed (%s: %s); this job runs unmonitored", type(exc).__name__, exc)
        except Exception:  # noqa: BLE001
            pass

    def _remove_pre_hook(self) -> None:
        h, self._pre_handle = self._pre_handle, None
        if h is not None:
            h.remove()  # safe inside the hook: torch iterates over a copy of the global hooks
        f, self._filter = self._filter, None
        if f is not None:
            try:
                warnings.filters.remove(f)
            except ValueError:
                pass

    def _remove_post_hook(self) -> None:
        h, self._post_handle = self._post_handle, None
        if h is not None:
            remove_global_hook(h)  # also out of torch's with_kwargs table

    def disarm(self) -> None:
        """Remove every hook this attacher registered (tests; the optimizer hook included). Never raises."""
        self._remove_pre_hook()
        self._remove_post_hook()
        h, self._opt_handle = self._opt_handle, None
        if h is not None:
            h.remove()


def _default_agent(model: nn.Module, optimizer: Any) -> Any:
    from ..core import Agent

    return Agent(model, optimizer)
