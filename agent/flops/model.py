"""FLOPs per optimizer step: user value, analytic transformer formula, or a one-time FlopCounterMode count.

Order of preference (the first available wins):

1. ``flops_per_step`` given by the user (and ``hardware_flops_per_step``, if given);
2. the analytic decoder-transformer formula of PaLM (Chowdhery et al. 2022,
   appendix B), when the model's shape is known (``model_shape`` or a Hugging
   Face ``model.config``)::

       model FLOPs per token = 6 * N + 12 * L * d * T

   with N the number of parameters used in matmuls (embedding lookups
   excluded; the output projection is a matmul and counts), L layers, d the
   model width and T the sequence length. The first term is the forward (2N)
   and backward (4N) of every weight matmul; the second the attention score
   and value matmuls (QK^T and PV, forward and backward), not halved for a
   causal mask;
3. measured once with :class:`torch.utils.flop_counter.FlopCounterMode` over
   one real optimizer step (every micro-batch's forward and backward).

Model FLOPs (MFU's numerator) exclude activation recomputation; hardware FLOPs
(HFU's numerator) include it. FlopCounterMode counts what executes, so with
``torch.utils.checkpoint`` it sees the recomputed forward too. We separate the
two with the matmul identity "backward = 2 x forward": model FLOPs =
min(3 * forward-phase FLOPs, executed FLOPs) and hardware FLOPs = executed
FLOPs. (With frozen weights and checkpointing together this over-states model
FLOPs; give ``flops_per_step`` then.) The analytic path has no executed count:
its hardware FLOPs add one forward (2N + 4LdT per token, i.e. a third of the
model FLOPs) when the model reports gradient checkpointing
(``is_activation_checkpointing``, formerly ``is_gradient_checkpointing``, as Hugging Face models do).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from .counter import StepFlopCounter, split_model_hardware

log = logging.getLogger("mfuwatch")


def analytic_flops_per_token(n_matmul_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Model FLOPs per token for one forward+backward: ``6 N + 12 L d T`` (PaLM appendix B).

    Args:
        n_matmul_params: N, parameters used in matmuls (embeddings excluded).
        n_layers: L. d_model: d. seq_len: T (tokens per sequence).

    Returns:
        FLOPs per token (float).

    Raises:
        ValueError: if any argument is negative.
    """
    if min(n_matmul_params, n_layers, d_model, seq_len) < 0:
        raise ValueError("analytic_flops_per_token: arguments must be non-negative")
    return 6.0 * n_matmul_params + 12.0 * n_layers * d_model * seq_len


def count_matmul_params(model: nn.Module) -> int:
    """N for the analytic formula: weights of every ``nn.Linear`` call site (and ``Conv1D``-style modules).

    A weight shared by two Linear modules (e.g. a tied output projection) counts
    once per module, since each module performs its own matmul. Embedding tables
    are excluded (a lookup is not a matmul); biases and norm weights are
    excluded (O(d) work per token, not O(d^2)).
    """
    n = 0
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            n += mod.weight.numel()
        elif type(mod).__name__ == "Conv1D" and hasattr(mod, "weight") and getattr(mod.weight, "dim", lambda: 0)() == 2:
            n += mod.weight.numel()  # Hugging Face GPT-2's transposed Linear
    return n


@dataclass
class TransformerShape:
    """What the analytic formula needs; ``seq_len`` may be filled in from the inputs."""

    n_layers: int
    d_model: int
    n_params: int
    seq_len: Optional[int] = None
    gradient_checkpointing: bool = False


def uses_activation_checkpointing(model: Optional[nn.Module]) -> bool:
    """Whether a (Hugging Face) model reports activation checkpointing.

    transformers 5 names it ``is_activation_checkpointing`` (``is_gradient_checkpointing``
    is its deprecated alias); older versions have only the latter.
    """
    if model is None:
        return False
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or name in getattr(model, "__dict__", {}):
            return bool(getattr(model, name, False))
    return False


def shape_from_hf_config(model: nn.Module) -> Optional[TransformerShape]:
    """Read layers and width from a Hugging Face ``model.config``; ``None`` if absent or not a decoder LM."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    get = lambda *names: next((getattr(cfg, k) for k in names if isinstance(getattr(cfg, k, None), int)), None)  # noqa: E731
    layers = get("num_hidden_layers", "n_layer", "num_layers")
    width = get("hidden_size", "n_embd", "d_model")
    if not layers or not width:
        return None
    return TransformerShape(
        n_layers=layers,
        d_model=width,
        n_params=count_matmul_params(model),
        seq_len=None,
        gradient_checkpointing=uses_activation_checkpointing(model),
    )


class FlopModel:
    """Model and hardware FLOPs per optimizer step for one training process: the agent's FLOP source.

    Picks the first source that applies: ``flops_per_step`` from the config
    (``source`` "user"); the analytic formula (``"analytic"``) of
    :mod:`.architectures` for a Hugging Face model it knows, or of PaLM for
    ``model_shape``; else one real step counted with ``FlopCounterMode``
    (``"flop_counter"``). ``""`` when none applies (MFU is not reported).

    The training thread calls :meth:`on_forward_start`, :meth:`on_forward_end`
    and :meth:`on_step_end` (shape reads and counter calls only; failures are
    counted under ``flops`` in ``errors`` and switch counting off for good,
    never raise); the agent thread calls :meth:`flops_per_step`, which also
    re-reads the trainable set when it changed (a PEFT adapter enabled, merged
    or a layer unfrozen).

    Args:
        model: the trained module, or None.
        config: the agent's :class:`~mfuwatch.agent.config.AgentConfig`.
        errors: the agent's :class:`~mfuwatch.agent.errors.ErrorCounter`.

    Raises:
        ConfigError: ``model_shape`` without ``n_params`` and no model.
    """

    def __init__(self, model: Optional[nn.Module], config: Any, errors: Any) -> None:
        self._said_no_count = False  # the fullgraph warning of on_forward_start, once
        from ..config import ConfigError

        self.model, self.config, self.errors = model, config, errors
        self.source = ""
        self.reason = ""  # why the analytic path was not taken, for the breakdown
        self.arch: Any = None
        self.shape: Optional[TransformerShape] = None
        self.counter: Optional[StepFlopCounter] = None
        self.model_flops_per_token: Optional[float] = None
        self.hw_flops_per_token: Optional[float] = None
        self.lengths: Any = None  # architectures.Lengths of the latest training forward
        self._signature: Any = None
        self._adopted = False  # an architecture read from the unwrapped model: the live one is not re-read
        self.six_n: Optional[int] = None  # N of flops_convention "6n" (agent/flops/conventions.py)
        cfg = config
        if cfg.flops_per_step is not None:
            self.source = "user"
            return
        try:
            if cfg.model_shape is not None:
                ms = cfg.model_shape
                n = ms.n_params if ms.n_params is not None else (count_matmul_params(model) if model is not None
                                                                 else None)
                if n is None:
                    raise ConfigError("model_shape.n_params: required when no model is given")
                self.shape = TransformerShape(ms.n_layers, ms.d_model, n, ms.seq_len,
                                              uses_activation_checkpointing(model))
            elif model is not None and getattr(model, "config", None) is not None:
                self._read_architecture()
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001
            errors.count("flops", exc)
        if getattr(cfg, "flops_convention", None) == "6n" and model is not None:
            from .conventions import six_n_parameters

            try:
                self.six_n = six_n_parameters(model)
            except Exception as exc:  # noqa: BLE001
                errors.count("flops", exc)
        if self.shape is not None or self.arch is not None or self.six_n is not None:
            self.source = "analytic"
        elif model is not None:
            self.source = "flop_counter"
            self.counter = StepFlopCounter()
            if self.reason:
                log.info("mfuwatch: FLOPs will be counted over one real step (%s)", self.reason)
        else:
            log.warning("mfuwatch: no model, no flops_per_step and no model_shape: MFU is not reported "
                        "(pass flops_per_step=... or model_shape={'n_layers':..,'d_model':..,'n_params':..})")

    # ------------------------------------------------------------ analytic
    def _read_architecture(self) -> None:
        from . import architectures

        cfg = self.config
        try:
            self.arch = architectures.from_model(self.model, causal=cfg.attention_flops == "causal",
                                                 tp=cfg.tensor_parallel_size, cp=cfg.context_parallel_size)
            self._signature = architectures.trainable_signature(self.model)
        except architectures.UnknownArchitecture as exc:
            self.arch, self.reason = None, str(exc)

    def adopt(self, arch: Any) -> bool:
        """Use ``arch`` (read from the unwrapped model, e.g. before FSDP flattened it) when the live model
        gave no analytic formula. Returns whether it was taken; the live model is then not re-read."""
        if arch is None or self.source != "flop_counter":
            return False
        self.close()
        self.arch, self.source, self._adopted = arch, "analytic", True
        arch.causal = self.config.attention_flops == "causal"
        arch.cp = self.config.context_parallel_size
        return True

    def refresh(self) -> None:
        """Re-read the model when its trainable set changed (agent thread; a walk over the parameters)."""
        if self.arch is None or self.model is None or self._adopted:
            return
        from . import architectures

        sig = architectures.trainable_signature(self.model)
        if sig != self._signature:
            self._read_architecture()
            if self.arch is None:  # became unknown: say so rather than keep a stale formula
                log.warning("mfuwatch: the model changed and the analytic FLOP formula no longer applies (%s); "
                            "MFU is not reported", self.reason)

    # ------------------------------------------------------- training thread
    def on_forward_start(self, args: tuple, kwargs: Any, step: int, may_start: bool = True) -> None:
        """A training forward begins (shape reads; starts the count on the second step, unless ``may_start``
        is False: a call through a ``torch.compile(fullgraph=True)`` wrapper, where a dispatch mode would make
        the compile fail). Never raises."""
        try:
            arch = self.arch
            if arch is not None and arch.family in ("encoder-decoder", "vision"):
                lengths = arch.lengths_from_inputs(args, kwargs)
                if lengths is not None:
                    self.lengths = lengths
            fc = self.counter
            if fc is not None:
                if not fc.active and step >= 1 and self.model_flops_per_token is None:
                    if may_start:
                        fc.start()  # count one real step (the 2nd: the 1st may hold lazy init)
                    elif not self._said_no_count:  # only a model that needs a count is told
                        self._said_no_count = True
                        log.warning("mfuwatch: the model runs through torch.compile(fullgraph=True) (or "
                                    "error_on_graph_break): FlopCounterMode cannot count a step through it and "
                                    "the model has no analytic FLOP formula; pass flops_per_step=... for MFU")
                fc.mark_forward_start()
        except Exception as exc:  # noqa: BLE001
            self._give_up(exc)

    def on_forward_end(self) -> None:
        """A training forward ended. Never raises."""
        try:
            fc = self.counter
            if fc is not None and fc.active:
                fc.mark_forward_end()
        except Exception as exc:  # noqa: BLE001
            self._give_up(exc)

    def on_step_end(self, tokens: Optional[int]) -> None:
        """The optimizer step ended with ``tokens`` tokens: close a running count. Never raises."""
        fc = self.counter
        if fc is None or not fc.active:
            return
        self.counter = None  # one count only, whatever happens below
        try:
            executed, forward = fc.finish()
        except Exception as exc:  # noqa: BLE001
            fc.abort()
            self.errors.count("flops", exc)
            log.warning("mfuwatch: the FLOP count of one step failed: MFU is not reported (pass flops_per_step=...)")
            return
        if tokens and executed:
            model, hw = split_model_hardware(executed, forward)
            self.model_flops_per_token = model / tokens
            self.hw_flops_per_token = hw / tokens
        elif not tokens:  # the FLOPs are fine: the forward carried no tensor the token rule reads
            log.warning("mfuwatch: the counted step saw 0 training tokens (no input_ids, inputs_embeds or tensor "
                        "argument in a forward with grad enabled and model.train()): MFU is not reported; pass "
                        "tokens_per_step=... or agent.step(tokens=...)")
        else:
            log.warning("mfuwatch: FlopCounterMode counted 0 FLOPs over %d tokens (the model's ops have no FLOP "
                        "formula): MFU is not reported (pass flops_per_step=...)", tokens)

    def _give_up(self, exc: BaseException) -> None:
        fc, self.counter = self.counter, None
        if fc is not None:
            fc.abort()
        self.errors.count("flops", exc)

    def close(self) -> None:
        """Leave a running count (the agent is closing). Never raises."""
        fc, self.counter = self.counter, None
        if fc is not None:
            fc.abort()

    # ---------------------------------------------------------- agent thread
    def _arch_lengths(self, seq_len: Optional[int]) -> Any:
        from .architectures import Lengths

        arch = self.arch
        if arch.family in ("encoder-decoder", "vision"):
            return self.lengths or arch.default_lengths
        return Lengths(int(seq_len)) if seq_len else None

    def flops_per_step(self, tokens_per_step: float, seq_len: Optional[int]) -> tuple:
        """``(model, hardware)`` FLOPs for one step of ``tokens_per_step`` counted tokens, or ``(None, None)``.

        ``seq_len``: tokens per sequence of the latest training forward (decoders, encoders).
        """
        cfg = self.config
        if cfg.flops_per_step is not None:
            return cfg.flops_per_step, cfg.hardware_flops_per_step or cfg.flops_per_step
        if self.six_n is not None:  # flops_convention "6n": 6 N per token, no attention term
            model = 6.0 * self.six_n * tokens_per_step
            if cfg.hardware_flops_per_step is not None:
                return model, cfg.hardware_flops_per_step
            return model, model * (4.0 / 3.0) if uses_activation_checkpointing(self.model) else model
        if self.shape is not None:
            s = self.shape
            seq = s.seq_len or seq_len
            if not seq:
                return None, None
            from .conventions import dense_flops_per_token

            model = dense_flops_per_token(cfg.flops_convention or "palm", s.n_params, s.n_layers, s.d_model,
                                          seq) * tokens_per_step
            if cfg.hardware_flops_per_step is not None:
                return model, cfg.hardware_flops_per_step
            return model, model * (4.0 / 3.0) if s.gradient_checkpointing else model
        if self.arch is not None:
            self.refresh()
            arch = self.arch
            if arch is None:
                return None, None
            lengths = self._arch_lengths(seq_len)
            if lengths is None:
                return None, None
            units = arch.units_per_sequence(lengths)
            if not units:
                return None, None
            model, hw, _ = arch.step_flops(lengths, tokens_per_step / units)
            return model, (cfg.hardware_flops_per_step if cfg.hardware_flops_per_step is not None else hw)
        if self.model_flops_per_token is not None:
            return self.model_flops_per_token * tokens_per_step, self.hw_flops_per_token * tokens_per_step
        return None, None

    def breakdown(self, tokens_per_step: Optional[float] = None, seq_len: Optional[int] = None,
                  count: bool = False) -> str:
        """Text: per-component FLOPs of one step and the formula of each (see :func:`flops_breakdown_text`).

        ``count``: also count one step of the model rebuilt from its config on the meta device.
        """
        text = flops_breakdown_text(self, tokens_per_step, seq_len)
        if count:
            text += "\n" + self._counted_line(tokens_per_step, seq_len)
        return text

    def _counted_line(self, tokens_per_step: Optional[float], seq_len: Optional[int]) -> str:
        """FlopCounterMode on a meta-device rebuild from ``model.config``, beside the analytic value."""
        from .config_count import count_from_config
        from .architectures import Lengths

        cfg = getattr(self.model, "config", None)
        if cfg is None:
            return "counted: not available (the model has no Hugging Face config to rebuild it from)"
        lengths = self._arch_lengths(seq_len) if self.arch is not None else (Lengths(seq_len) if seq_len else None)
        if lengths is None:
            return "counted: not available (no training forward seen yet)"
        arch = self.arch
        units = arch.units_per_sequence(lengths) if arch is not None else float(lengths.target)
        seqs = max(1, round(tokens_per_step / units)) if tokens_per_step and units else 1
        try:
            counted, untracked, where = count_from_config(cfg, arch, seqs, lengths.target, lengths.source)
        except Exception as exc:  # noqa: BLE001
            counted, untracked, where = None, [], f"{type(exc).__name__}: {exc}"
        if counted is None:
            return f"counted: not available ({where})"
        line = f"counted (FlopCounterMode, {where} rebuild from the config, {seqs} sequences): {counted:.4g} FLOPs"
        if arch is not None:
            _, hw, _ = arch.step_flops(lengths, seqs)
            line += f"; analytic hardware FLOPs {hw:.4g}" + (f" (ratio {hw / counted:.3f})" if counted else "")
        return line + "\nuntracked ops (counted 0): " + (", ".join(untracked) if untracked else "none")


def flops_breakdown_text(fm: FlopModel, tokens_per_step: Optional[float], seq_len: Optional[int]) -> str:
    """What made the FLOP number: the source, and for the analytic path the per-component table."""
    from .conventions import CONVENTIONS, formula_inputs

    conv = getattr(fm.config, "flops_convention", None) or "palm"
    lines = [f"flops_source: {fm.source or 'none (MFU not reported)'}"]
    if fm.source == "analytic":
        inputs = formula_inputs(fm, seq_len)
        if tokens_per_step:
            inputs["tokens_per_step"] = tokens_per_step
        lines.append(f"flops_convention: {conv} ({CONVENTIONS[conv]})")
        lines.append("formula inputs: " + ", ".join(f"{k}={v:,}" if isinstance(v, int) else f"{k}={v:g}"
                                                   for k, v in inputs.items()))
    if fm.six_n is not None:
        t = tokens_per_step or seq_len or 0
        lines.append(f"6 x N x tokens = 6 x {fm.six_n:,} x {t:g} = {6.0 * fm.six_n * t:.4g} model FLOPs per step")
        return "\n".join(lines)
    if fm.source == "user":
        lines.append(f"flops_per_step = {fm.config.flops_per_step:.4g} (given)")
        return "\n".join(lines)
    if fm.shape is not None:
        s = fm.shape
        lines.append(f"{CONVENTIONS[conv]}: N={s.n_params:,} L={s.n_layers} d={s.d_model} "
                     f"T={s.seq_len or seq_len}")
        return "\n".join(lines)
    if fm.arch is not None:
        from .architectures import describe

        lengths = fm._arch_lengths(seq_len)
        if lengths is None:
            return "\n".join(lines + ["no training forward seen yet: sequence length unknown"])
        units = fm.arch.units_per_sequence(lengths)
        seqs = (tokens_per_step / units) if (tokens_per_step and units) else 1.0
        from .config_count import lengths_text

        what = lengths_text(lengths, fm.arch.family, seqs)
        lines.append(f"family: {fm.arch.family} ({fm.arch.model_type}); {what}")
        lines.append(describe(fm.arch, lengths, seqs))
        lines += fm.arch.notes
        return "\n".join(lines)
    if fm.reason:
        lines.append(f"analytic formula not used: {fm.reason}")
    if fm.model_flops_per_token is not None:
        lines.append(f"counted over one real step: {fm.model_flops_per_token:.4g} model FLOPs per token, "
                     f"{fm.hw_flops_per_token:.4g} hardware FLOPs per token")
    return "\n".join(lines)
