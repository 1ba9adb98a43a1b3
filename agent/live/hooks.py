"""The training-thread side of the agent: forward hooks, the optimizer step hook, ``step()``, ``mark_gap()``.

These run on the training thread and do the least: add a batch's tokens (shape reads
only), record a step-clock marker (a CUDA event on GPUs: no host-device sync), and hand
the FLOP model its forward. Every failure is caught and counted under ``hooks``; none
reaches the training loop.

Under ``torch.compile(model)`` (the ``OptimizedModule`` wrapper), torch 2.13 traces the model's own module
hooks into the graph (older versions ran them before the compiled ``forward`` frame), where the agent's
clock reads and thread ids cannot go: a graph break and a warning, and with ``fullgraph=True`` the job's
compile failed; the FLOP count started inside the traced hook also missed the backward. The hooks
therefore do nothing while dynamo traces them (:func:`torch.compiler.is_compiling`), and a step that ended
without any eager forward of the model moves them to the wrapper (:class:`_WrapperHooks`: global module
hooks that act only for a ``torch.compile`` wrapper of the model, eagerly, around the compiled call); that
one step's tokens are the previous step's. Through a wrapper compiled with ``fullgraph=True`` (or
``error_on_graph_break``) the FLOP count is not started: dynamo refuses a frame under a dispatch mode
(``FlopCounterMode``), which such a compile turns into an error; a model without an analytic formula then
needs ``flops_per_step`` (said once in the log).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from ..device import peaks

log = logging.getLogger("mfuwatch")

#: True while dynamo traces the calling code (the hooks then do nothing: see the module docstring).
#: ``torch.compiler.is_compiling`` since torch 2.3; dynamo evaluates it to True at trace time.
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or torch._dynamo.is_compiling

#: The warning ``OptimizedModule.__call__`` gives at every call while any global module hook exists
#: (``torch._dynamo.eval_frame``); the agent's global hooks are meant to fire for the wrapper, so it is filtered
#: (by this message) for as long as they are in.
COMPILE_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"


def remove_global_hook(handle: Any) -> None:
    """Remove a global module hook (``torch.nn.modules.module.register_module_forward_*hook``). torch's handle
    of a ``with_kwargs`` global forward hook leaves its id in ``_global_forward_hooks_with_kwargs`` (torch
    2.13: not among the handle's ``extra_dict``), which keeps ``_has_any_global_hook()`` true and
    ``torch.compile``'s wrapper warning at every call of the job: the id is dropped there too."""
    from torch.nn.modules import module as module_mod

    handle.remove()
    left = getattr(module_mod, "_global_forward_hooks_with_kwargs", None)
    if isinstance(left, dict):
        left.pop(handle.id, None)


def count_tokens(args: tuple, kwargs: Mapping[str, Any]) -> tuple:
    """Tokens in one forward call's inputs: ``(tokens, seq_len or None)``.

    The input is ``input_ids`` / ``inputs_embeds`` if passed by keyword or inside a
    dict passed as an argument (``model(batch)`` with ``{"input_ids": …}``, a Hugging
    Face ``BatchEncoding``), else the first tensor argument. Integer tensors (token
    ids) of shape (B, T) give B·T; float tensors of shape (B, T, C) give B·T; any
    other shape counts its first dimension (samples, e.g. images). Shape reads only:
    no device sync.
    """
    t = None
    maps = [kwargs] + [a for a in args if isinstance(a, Mapping)]
    for key in ("input_ids", "inputs_embeds", "idx", "tokens", "x"):
        v = next((m.get(key) for m in maps if isinstance(m.get(key), torch.Tensor)), None)
        if isinstance(v, torch.Tensor):
            t = v
            break
    if t is None:
        t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if t is None:
        t = next((a for a in kwargs.values() if isinstance(a, torch.Tensor)), None)
    if t is None or t.dim() == 0:
        return 0, None
    if not t.is_floating_point() and t.dim() <= 2:
        return int(t.numel()), int(t.shape[-1])
    if t.is_floating_point() and t.dim() == 3:
        return int(t.shape[0] * t.shape[1]), int(t.shape[1])
    return int(t.shape[0]), None



@dataclass(frozen=True)
class HookWiring:
    """What the training-thread hooks feed, as narrow callables (each never raises into the hooks,
    or is guarded by them): ``mark(step, tokens, loss)`` records a step-clock boundary and returns its
    wall-clock stamp; ``clock_start()`` times the first step from its first forward; ``clock_gap(step)``
    leaves the time since the last step out of step timing; ``on_dtype(key)`` is told the training
    dtype when a forward first shows it or it changes; ``forward_start()`` and ``boundary(step)`` are
    fleet accounting's; ``on_step(step)`` is the profiler sampler's; ``last_step_wall(t)`` sets the
    exporter's last-step time."""

    mark: Callable[[int, int, Any], float]
    clock_start: Callable[[], None]
    clock_gap: Callable[[int], None]
    on_dtype: Callable[[str], None]
    forward_start: Callable[[], None]
    boundary: Callable[[int], None]
    on_step: Callable[[int], None]
    last_step_wall: Callable[[float], None]
    stall_step: Callable[[], None] = lambda: None  # the stall clock's step(): both alert paths read it


class TrainingHooks:
    """Everything the training thread calls: forward hooks, the optimizer step hook, ``step()``, ``mark_gap()``.

    Owns the training-thread state: the optimizer step count (:attr:`step`), the tokens counted since
    the last boundary, the sequence length (:attr:`seq_len`), the pending loss, the training dtype key
    (:attr:`dtype_key`) and the hook handles. Args: ``device`` (the training ``torch.device``),
    ``flop_model`` (its ``on_forward_start/on_forward_end/on_step_end``, which never raise),
    ``errors`` (counts failures under ``hooks``), ``wiring`` (:class:`HookWiring`), ``tokens_per_step``
    (the configured count, or None to count inputs), ``dtype`` (a configured dtype key: final, not
    detected) and ``has_optimizer`` (``step()`` is then ignored, once with a warning).
    """

    def __init__(self, *, device: torch.device, flop_model: Any, errors: Any, wiring: HookWiring,
                 tokens_per_step: Optional[int] = None, dtype: Optional[str] = None,
                 has_optimizer: bool = False) -> None:
        self.device, self.flop_model, self.errors, self.wiring = device, flop_model, errors, wiring
        self.tokens_per_step, self.configured_dtype, self.has_optimizer = tokens_per_step, dtype, has_optimizer
        self.step = 0
        self.seq_len: Optional[int] = None
        self.dtype_key: Optional[str] = dtype
        self.closed = False
        self._pending_tokens = 0
        self._pending_loss: Any = None
        self._clock_started = False
        self._explicit_warned = False
        self._handles: list = []
        self._model: Optional[nn.Module] = None
        self._forward_handles: list = []
        self._eager_forward = False  # a hook of the model ran eagerly since the last boundary
        self._last_tokens = 0  # the tokens of the last step whose forwards were seen
        self._wrapper: Optional["_WrapperHooks"] = None
        self._in_wrapper = 0  # inside a call of the torch.compile wrapper (its hooks speak for the model's)

    def install(self, model: Optional[nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Register the forward pre/post hooks on ``model`` and the step post-hook on ``optimizer``."""
        if model is not None:
            self._model = model
            if getattr(model, "_compiled_call_impl", None) is not None:
                self._forward_handles = [_CompiledInPlace(model, self._pre_forward, self._post_forward)]
            else:
                self._forward_handles = [model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                                         model.register_forward_hook(self._post_forward)]
            self._handles.extend(self._forward_handles)
        if optimizer is not None:
            self._handles.append(optimizer.register_step_post_hook(self._post_optimizer_step))

    def close(self) -> None:
        """Remove the hooks; later calls do nothing. Never raises (failures counted under ``close``)."""
        self.closed = True
        for h in self._handles:
            with self.errors.guard("close"):
                h.remove()
        self._handles.clear()

    def _count_inputs(self, args: tuple, kwargs: Mapping[str, Any]) -> None:
        """Add one training forward's tokens (:func:`count_tokens`) unless ``tokens_per_step`` is configured."""
        if self.tokens_per_step is None:
            n, seq = count_tokens(args, kwargs)
            self._pending_tokens += n
            if seq:
                self.seq_len = seq

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict, may_count: bool = True,
                     wrapper: bool = False, count_inputs: bool = True) -> None:
        if _is_compiling():  # traced into a graph: nothing here (see the module docstring)
            return None
        if self._in_wrapper and not wrapper:  # the model's own hooks run eagerly inside a wrapper call (a
            return None  # graph break): the wrapper's hooks already counted this forward
        try:
            self._eager_forward = True
            if not torch.is_grad_enabled() or not module.training:
                # Training tokens are those of forwards with autograd on and the model in train mode;
                # a metric pass in model.eval() (with or without no_grad) is not training. A model trained
                # in eval mode passes its tokens with step(tokens=...) or tokens_per_step.
                return None
            self.wiring.forward_start()  # fleet: goodput's input-wait / step split
            if count_inputs:
                self._count_inputs(args, kwargs)
            if self.step == 0 and not self._clock_started:
                self._clock_started = True
                self.wiring.clock_start()  # time the first step from its first forward
            if self.configured_dtype is None:  # a configured dtype is final
                self._detect_dtype(module)  # the first forward shows the dtype; a change re-chooses the peak
            self.flop_model.on_forward_start(args, kwargs, self.step, may_start=may_count)  # never raises
        except Exception as exc:  # noqa: BLE001
            self.errors.count("hooks", exc)
        return None

    def _post_forward(self, module: nn.Module, args: tuple, output: Any, wrapper: bool = False) -> None:
        if _is_compiling() or (self._in_wrapper and not wrapper):
            return None
        self.flop_model.on_forward_end()  # never raises
        return None

    def _follow_wrapper(self) -> Optional[int]:
        """At a boundary: a step in which no hook of the model ran eagerly means that its hooks were traced
        into a compiled graph; move them to the compiled wrapper (once) and return the tokens to count for
        this step (the previous step's), else None."""
        if self._eager_forward or self._model is None or self.closed:
            self._eager_forward = False
            return None
        try:
            if self._wrapper is None:
                self._wrapper = _WrapperHooks(self._model, self)
                self._handles.append(self._wrapper)
            elif not self._wrapper.searching:
                self._wrapper.search()  # a new wrapper (compiled again): find it
            else:
                return self._last_tokens  # still searching (no wrapper call yet): said once already
            log.info("mfuwatch: step %d saw no eager forward of %s (torch.compile traces its hooks into the "
                     "graph): the agent's forward hooks now run around the torch.compile wrapper; this step's "
                     "tokens are the previous step's (%d)", self.step, type(self._model).__name__, self._last_tokens)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("hooks", exc)
        return self._last_tokens

    def _detect_dtype(self, module: nn.Module) -> None:
        dev = self.device.type
        autocast_dtype = None
        try:
            if torch.is_autocast_enabled(dev) if _autocast_takes_device() else (
                    torch.is_autocast_enabled() if dev == "cuda" else torch.is_autocast_cpu_enabled()):
                autocast_dtype = torch.get_autocast_dtype(dev) if hasattr(torch, "get_autocast_dtype") else (
                    torch.get_autocast_gpu_dtype() if dev == "cuda" else torch.get_autocast_cpu_dtype())
        except Exception:  # noqa: BLE001
            autocast_dtype = None
        p = next(module.parameters(), None)
        param_dtype = p.dtype if p is not None else torch.float32
        key = peaks.training_dtype_key(param_dtype, autocast_dtype, dev == "cuda" and peaks.torch_allows_tf32())
        if key != self.dtype_key:
            self.dtype_key = key
            self.wiring.on_dtype(key)

    def _post_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._follow_compile()
        self.boundary(None, None)

    def _follow_compile(self) -> None:
        """Move the forward hooks outside a ``module.compile()`` done after :meth:`install` (one attribute read
        per step otherwise). Module hooks run inside an in-place compiled ``_call_impl``, where the counted
        path sees only part of the step's FLOPs."""
        model = self._model
        if model is None or self.closed:
            return
        compiled = getattr(model, "_compiled_call_impl", None)
        if compiled is None or isinstance(compiled, _CompiledInPlace.Call):
            return
        try:
            for h in self._forward_handles:
                h.remove()
                self._handles.remove(h)
            self._forward_handles = [_CompiledInPlace(model, self._pre_forward, self._post_forward)]
            self._handles.extend(self._forward_handles)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("hooks", exc)

    def explicit_step(self, tokens: Optional[int] = None, loss: Any = None) -> None:
        """``Agent.step()``: a boundary, unless the optimizer's hook marks them (then ignored, warned once)."""
        if self.has_optimizer:
            if not self._explicit_warned:
                self._explicit_warned = True
                log.warning("mfuwatch: agent.step() ignored: the optimizer's step hook already marks steps "
                            "(use record_loss() to attach a loss)")
            return
        self.boundary(tokens, loss)

    def mark_gap(self) -> None:
        """``Agent.mark_gap()``: the next step is timed from here. Nothing before the first forward."""
        if self.closed or (self.step == 0 and not self._clock_started):
            return  # nothing is being timed yet
        try:
            self.wiring.clock_gap(self.step)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("hooks", exc)

    def record_loss(self, loss: Any) -> None:
        """Attach a loss (float or tensor) to the current step; read later without a sync on this thread."""
        try:
            self._pending_loss = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("hooks", exc)

    def boundary(self, tokens: Optional[int], loss: Any) -> None:
        """One optimizer step ended: count it, hand the clock its marker and the parts their boundary."""
        if self.closed:
            return
        try:
            self.step += 1
            carried = self._follow_wrapper()
            if tokens is None:
                tokens = self.tokens_per_step if self.tokens_per_step is not None else self._pending_tokens
                if carried is not None and self.tokens_per_step is None and not self._pending_tokens:
                    tokens = carried
                self._last_tokens = tokens or self._last_tokens
            self._pending_tokens = 0
            if loss is None:
                loss, self._pending_loss = self._pending_loss, None
            elif isinstance(loss, torch.Tensor):
                loss = loss.detach()
            self.flop_model.on_step_end(tokens)  # never raises; always leaves FlopCounterMode
            # the boundary's own wall-clock stamp: mfuwatch_last_step_timestamp_seconds moves per step, not per report
            self.wiring.last_step_wall(self.wiring.mark(self.step, int(tokens or 0), loss))
            self.wiring.stall_step()  # both alert paths' stall clock (monotonic): a step ended now
            self.wiring.boundary(self.step)  # fleet: goodput bucket of the step, hang watchdog
            self.wiring.on_step(self.step)  # profiler windows on their cadence
        except Exception as exc:  # noqa: BLE001
            self.errors.count("hooks", exc)


def _autocast_takes_device() -> bool:
    try:
        torch.is_autocast_enabled("cpu")
        return True
    except TypeError:
        return False


class _CompiledInPlace:
    """The agent's forward hooks around a module compiled in place (``module.compile()``), outside the graph.

    ``module.compile()`` sets ``module._compiled_call_impl = torch.compile(module._call_impl)`` and
    ``Module.__call__`` then calls it instead of ``_call_impl``; hooks registered on the module run inside
    the compiled function, where ``FlopCounterMode`` entered by the pre-hook misses the backward (a small
    MLP counted 1.05 MFLOP of its 2.62 MFLOP step). This handle puts a plain function in that slot that
    runs ``pre(module, args, kwargs)``, the compiled call, then ``post(module, args, output)``: the hooks
    run eagerly, as they do around ``torch.compile(module)``'s wrapper. :meth:`remove` restores the
    compiled call if the slot still holds this handle's function.
    """

    class Call:
        """The callable placed in ``_compiled_call_impl`` (a type, so a second install can recognise it)."""

        def __init__(self, compiled: Any, module: nn.Module, pre: Any, post: Any) -> None:
            self.compiled, self.module, self.pre, self.post = compiled, module, pre, post

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            self.pre(self.module, args, kwargs)
            out = self.compiled(*args, **kwargs)
            self.post(self.module, args, out)
            return out

    def __init__(self, module: nn.Module, pre: Any, post: Any) -> None:
        self.module = module
        self.call = _CompiledInPlace.Call(module._compiled_call_impl, module, pre, post)
        module._compiled_call_impl = self.call

    def remove(self) -> None:
        """Restore the module's compiled call (only if the slot still holds this handle's function)."""
        if getattr(self.module, "_compiled_call_impl", None) is self.call:
            self.module._compiled_call_impl = self.call.compiled


class _WrapperHooks:
    """The agent's forward hooks around the ``torch.compile`` wrapper of ``model`` (an ``OptimizedModule``
    whose ``_orig_mod`` is ``model``, or a DDP/FSDP wrapper of it with ``.module``), outside the graph.

    The wrapper object is not known in advance: torch's global module hooks find it at its next call (the
    wrapper's own ``__call__`` runs them eagerly; every other module returns at once after a dict read; inside
    a compiled graph they do nothing), and then give way to hooks on the wrapper itself (``with_kwargs``:
    Hugging Face models take ``input_ids=...``), so eager modules stop paying for global hooks. The call that
    finds it counts its tokens in the global forward hook, which sees the keyword arguments. While the global
    hooks are in, torch warns at each wrapper call that they fire "an extra time" for the wrapper: that is the
    point here, so that one warning is filtered (by its message) until they go. :meth:`search` looks for a new wrapper (the model compiled
    again); :meth:`remove` removes every hook."""

    def __init__(self, model: nn.Module, hooks: "TrainingHooks") -> None:
        self.model, self.hooks = model, hooks
        self._global: list = []
        self._instance: list = []
        self.wrappers: list = []
        self._filter: Any = None
        self.search()

    @property
    def searching(self) -> bool:
        return bool(self._global)

    def _ours(self, mod: nn.Module) -> bool:
        sub = getattr(mod, "_modules", None)  # a plain dict read: no nn.Module.__getattr__
        orig = sub.get("_orig_mod") if isinstance(sub, dict) else None
        return orig is not None and (orig is self.model or getattr(orig, "module", None) is self.model)

    def search(self) -> None:
        """Install the global hooks that find the next wrapper call."""
        from torch.nn.modules import module as module_mod

        import warnings

        if self._global:
            return
        hooks, model = self.hooks, self.model
        found: list = []
        warnings.filterwarnings("ignore", message=COMPILE_HOOK_WARNING, category=UserWarning)
        self._filter = warnings.filters[0]  # taken out again with the global hooks

        def _pre(mod: nn.Module, args: tuple) -> None:
            if _is_compiling():
                return
            try:
                if self._ours(mod) and not any(w is mod for w in self.wrappers):
                    found.append(mod)
                    hooks._pre_forward(model, args, {}, may_count=self._may_count(mod), wrapper=True,
                                       count_inputs=False)
                    hooks._in_wrapper += 1
            except Exception as exc:  # noqa: BLE001 - a global hook: never into the training loop
                hooks.errors.count("hooks", exc)

        def _post(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:  # always_call
            if _is_compiling():
                return
            try:
                if found and mod is found[0]:
                    found.clear()
                    hooks._in_wrapper = max(0, hooks._in_wrapper - 1)
                    if torch.is_grad_enabled() and model.training:
                        hooks._count_inputs(args, kwargs)
                    hooks._post_forward(model, args, output, wrapper=True)
                    self._adopt(mod)
            except Exception as exc:  # noqa: BLE001
                hooks.errors.count("hooks", exc)

        self._global = [module_mod.register_module_forward_pre_hook(_pre)]
        try:
            self._global.append(module_mod.register_module_forward_hook(_post, with_kwargs=True, always_call=True))
        except TypeError:  # a torch before always_call (2.1)
            self._global.append(module_mod.register_module_forward_hook(_post, with_kwargs=True))

    def _adopt(self, wrapper: nn.Module) -> None:
        """Hooks on ``wrapper`` itself from now on; the global hooks go."""
        hooks, model = self.hooks, self.model
        may = self._may_count(wrapper)

        def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if not _is_compiling():
                hooks._pre_forward(model, args, kwargs, may_count=may, wrapper=True)
                hooks._in_wrapper += 1
            return None

        def post(mod: nn.Module, args: tuple, output: Any) -> None:
            if not _is_compiling():
                hooks._in_wrapper = max(0, hooks._in_wrapper - 1)
                hooks._post_forward(model, args, output, wrapper=True)
            return None

        self.wrappers.append(wrapper)
        self._instance.append(wrapper.register_forward_pre_hook(pre, with_kwargs=True))
        try:
            self._instance.append(wrapper.register_forward_hook(post, always_call=True))
        except TypeError:
            self._instance.append(wrapper.register_forward_hook(post))
        self._drop_global()

    def _drop_global(self) -> None:
        """Remove the global hooks (:func:`remove_global_hook`) and the warning filter that came with them."""
        import warnings

        for h in self._global:
            remove_global_hook(h)
        self._global = []
        f, self._filter = self._filter, None
        if f is not None:
            try:
                warnings.filters.remove(f)
            except ValueError:  # the user's code reset the filters
                pass

    def _may_count(self, wrapper: nn.Module) -> bool:
        """Whether ``FlopCounterMode`` may be entered around this wrapper's call: not when it was compiled
        with ``fullgraph=True`` / ``error_on_graph_break=True``, or when this torch does not say."""
        ctx = getattr(wrapper, "dynamo_ctx", None)
        full, strict = getattr(ctx, "fullgraph", None), getattr(ctx, "error_on_graph_break", None)
        return full is False and not strict  # the flop model says so once if it needed the count

    def remove(self) -> None:
        self._drop_global()
        for h in self._instance:
            h.remove()
        self._instance = []
