"""The analytic FLOP model's types: weight matmuls, attention layers, sequence lengths, components.

:class:`ArchitectureModel` is what :func:`mfuwatch.agent.flops.architectures.from_model` reads from a
model; :meth:`ArchitectureModel.step_flops` gives model and hardware FLOPs of one step with the
formulas of :mod:`mfuwatch.agent.flops.architectures` (PaLM, Chowdhery et al. 2022, appendix B), and
:func:`describe` prints them per component.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple


class UnknownArchitecture(ValueError):
    """The analytic path does not know this model; the message says what it could not place."""


@dataclass(frozen=True)
class Matmul:
    """One weight matmul: ``params`` weights (already scaled by ``top_k/n_experts`` for routed experts).

    ``runs_on``: "target" (every target token), "source" (every source token),
    "sequence" (once per sequence, e.g. a pooler), "patch" (every image patch).
    """

    path: str
    component: str
    params: float
    trainable: bool
    runs_on: str = "target"
    input_grad: bool = True
    recomputed: bool = False


@dataclass(frozen=True)
class AttentionLayer:
    """One attention block: ``width`` = query heads × head_dim (divided by TP)."""

    index: int
    role: str  # "causal" | "bidirectional" | "cross"
    width: float
    kind: str = "full"  # "full" | "sliding" | "chunked"
    window: Optional[int] = None
    recomputed: bool = False
    on_source: bool = False  # an encoder layer of an encoder-decoder: its queries are the source tokens
    backward_matmuls: int = 4  # of dQ, dK, dP, dV: those whose input requires a gradient


@dataclass(frozen=True)
class Lengths:
    """Tokens per sequence: ``target`` (decoder / encoder / ViT tokens), ``source`` (encoder side of enc-dec)."""

    target: int
    source: Optional[int] = None


@dataclass
class Component:
    """One line of a breakdown: FLOPs per step (model and hardware) and the formula behind them."""

    name: str
    model_flops: float
    hardware_flops: float
    formula: str


@dataclass
class ArchitectureModel:
    """What the analytic count needs, read once from a model (see the module docstring).

    Build with :func:`from_model`. ``family`` is "decoder", "encoder",
    "encoder-decoder" or "vision".
    """

    family: str
    model_type: str
    matmuls: List[Matmul]
    attention: List[AttentionLayer]
    causal: bool = False
    cp: int = 1
    patch_size: Optional[Tuple[int, int]] = None
    extra_tokens: int = 0
    default_lengths: Optional[Lengths] = None
    notes: List[str] = field(default_factory=list)

    # ------------------------------------------------------------------ inputs
    def lengths_from_inputs(self, args: tuple, kwargs: Mapping[str, Any]) -> Optional[Lengths]:
        """Sequence lengths of one forward call from its tensor shapes (no device sync); None if not found.

        Decoders and encoders: ``input_ids`` / ``inputs_embeds`` (B, T[, C]).
        Encoder-decoders: source from ``input_ids``, target from ``decoder_input_ids`` or
        ``labels`` (B, T). Vision: ``pixel_values`` (B, C, H, W) → ``(H/p)·(W/p) + extra`` tokens.
        """
        def tensor(*names: str) -> Any:
            for n in names:
                v = kwargs.get(n)
                if v is not None and hasattr(v, "shape"):
                    return v
            return None

        first = next((a for a in args if hasattr(a, "shape")), None)
        if self.family == "vision":
            px = tensor("pixel_values")
            px = first if px is None else px
            if px is None or len(px.shape) != 4 or self.patch_size is None:
                return None
            ph, pw = self.patch_size
            return Lengths(target=(int(px.shape[-2]) // ph) * (int(px.shape[-1]) // pw) + self.extra_tokens)
        src = tensor("input_ids", "inputs_embeds")
        src = first if src is None else src
        if src is None or len(src.shape) < 2:
            return None
        if self.family == "encoder-decoder":
            tgt = tensor("decoder_input_ids", "labels", "decoder_inputs_embeds")
            if tgt is None or len(tgt.shape) < 2:
                return None
            return Lengths(target=int(tgt.shape[1]), source=int(src.shape[1]))
        return Lengths(target=int(src.shape[1]))

    def units_per_sequence(self, lengths: Lengths) -> float:
        """What the agent's token counter counts per sequence: encoder tokens, target tokens, or 1 image."""
        if self.family == "vision":
            return 1.0
        if self.family == "encoder-decoder":
            return float(lengths.source or 0)
        return float(lengths.target)

    # ------------------------------------------------------------------ FLOPs
    def _tokens(self, runs_on: str, L: Lengths) -> float:
        if runs_on == "source":
            return float(L.source or 0)
        if runs_on == "sequence":
            return 1.0
        if runs_on == "patch":
            return float(L.target - self.extra_tokens)
        return float(L.target)

    def _pairs(self, layer: AttentionLayer, L: Lengths) -> float:
        t = int(L.source or 0) if layer.on_source else L.target
        if layer.role == "cross":
            return float(t) * float(L.source or 0)
        tk = t * self.cp  # context parallelism: a local query sees the whole sequence's keys
        causal = self.causal and layer.role == "causal"
        if layer.kind == "sliding" and layer.window:
            w = layer.window
            if not causal:
                return float(t) * min(w, tk)
            # Σ_{i<tk} min(i+1, w), scaled to the local share of queries
            full = tk * (tk + 1) / 2 if tk <= w else w * (w + 1) / 2 + (tk - w) * w
            return full * t / tk
        if layer.kind == "chunked" and layer.window:
            c = layer.window
            n, r = divmod(tk, c)
            if causal:
                full = n * c * (c + 1) / 2 + r * (r + 1) / 2
            else:
                full = n * c * c + r * r
            return full * t / tk
        if causal:
            return tk * (tk + 1) / 2 * t / tk
        return float(t) * tk

    def step_flops(self, lengths: Lengths, sequences: float = 1.0) -> Tuple[float, float, List[Component]]:
        """``(model, hardware, components)`` FLOPs for ``sequences`` sequences of ``lengths``.

        Raises:
            ValueError: a length is missing (e.g. no source length for an encoder-decoder).
        """
        if self.family == "encoder-decoder" and not lengths.source:
            raise ValueError("encoder-decoder FLOPs need the source length (input_ids)")
        by: Dict[str, List[float]] = {}
        factors: Dict[str, Dict[Tuple[int, str], float]] = {}
        for mm in self.matmuls:
            per_tok = 2 + (2 if mm.input_grad else 0) + (2 if mm.trainable else 0)
            toks = self._tokens(mm.runs_on, lengths) * sequences
            model = per_tok * mm.params * toks
            hw = model + (2.0 * mm.params * toks if mm.recomputed else 0.0)
            acc = by.setdefault(mm.component, [0.0, 0.0])
            acc[0] += model
            acc[1] += hw
            f = factors.setdefault(mm.component, {})
            f[(per_tok, mm.runs_on)] = f.get((per_tok, mm.runs_on), 0.0) + mm.params
        formulas = {name: " + ".join(f"{k} x {n:,.0f} weights x {self._tokens(on, lengths) * sequences:,.0f} "
                                     f"{on} tokens" for (k, on), n in sorted(f.items(), key=lambda kv: -kv[0][0]))
                    for name, f in factors.items()}
        att = [0.0, 0.0]
        for layer in self.attention:
            pairs = self._pairs(layer, lengths) * sequences
            fwd = 4.0 * layer.width * pairs
            total = fwd * (1.0 + layer.backward_matmuls / 2.0)  # forward: 2 matmuls; each backward one: 1
            att[0] += total
            att[1] += total + (fwd if layer.recomputed and layer.backward_matmuls else 0.0)
        comps = [Component(n, a[0], a[1], formulas[n]) for n, a in by.items()]
        if self.attention:
            conv = "causal pairs" if self.causal else "all pairs (PaLM)"
            comps.append(Component("attention scores", att[0], att[1],
                                   f"12 x heads*head_dim x (query, key) pairs over {len(self.attention)} "
                                   f"attention blocks, {conv}"))
        model = sum(c.model_flops for c in comps)
        hw = sum(c.hardware_flops for c in comps)
        return model, hw, comps

    def frozen_share(self, lengths: Lengths) -> float:
        """Share of the weight-matmul model FLOPs spent on frozen weights (0..1)."""
        tot = frz = 0.0
        for mm in self.matmuls:
            per_tok = 2.0 + (2.0 if mm.input_grad else 0.0) + (2.0 if mm.trainable else 0.0)
            f = per_tok * mm.params * self._tokens(mm.runs_on, lengths)
            tot += f
            frz += 0.0 if mm.trainable else f
        return frz / tot if tot else 0.0


# ---------------------------------------------------------------------- reading a model


def describe(arch: ArchitectureModel, lengths: Lengths, sequences: float = 1.0) -> str:
    """A plain-text table of :meth:`ArchitectureModel.step_flops` (for the CLI and ``flops_breakdown``)."""
    model, hw, comps = arch.step_flops(lengths, sequences)
    rows = [f"{'component':<24} {'model FLOPs':>14} {'share':>7}  formula"]
    for c in comps:
        share = c.model_flops / model if model else 0.0
        rows.append(f"{c.name:<24} {c.model_flops:>14.4g} {share:>7.1%}  {c.formula}")
    rows.append(f"{'total (model)':<24} {model:>14.4g}")
    rows.append(f"{'recomputation':<24} {hw - model:>14.4g}          hardware FLOPs = {hw:.4g}")
    rows.append(f"{'frozen share':<24} {arch.frozen_share(lengths):>14.1%}")
    return "\n".join(rows)
