"""The exporter's suggestion series: gains and the agent's ranking, which the alert rules read."""

from __future__ import annotations

import time

from mfuwatch.agent.live.exporter import Exporter
from mfuwatch.agent.schema import CATEGORIES, M, RunInfo, Suggestion, WindowMeasurement


def _window(suggestions):
    return WindowMeasurement(step=1, timestamp=time.time(), steps=3, wall_seconds=1.0, busy_seconds=0.5,
                             breakdown={c: 0.2 for c in CATEGORIES}, memory_bound_share=0.6,
                             suggestions=suggestions)


def test_order_gauge_is_the_agents_ranking_not_the_order_of_the_gains():
    # ranked as the agent ranks them (existing fixes first, then by gain): torch_compile comes first although
    # the rms_norm drop-in's gain is larger
    ranked = [Suggestion(kernel="torch_compile", title="t", apply="model = torch.compile(model)", ops=["a"],
                         time_seconds=0.01, expected_gain=0.05),
              Suggestion(kernel="fused_adamw", title="t", apply="fused=True", ops=["b"], time_seconds=0.01,
                         expected_gain=0.02),
              Suggestion(kernel="rms_norm", title="t", apply="patch(model)", ops=["c"], time_seconds=0.02,
                         expected_gain=0.123, kind="bundled")]
    ex = Exporter(RunInfo(run="t"))
    ex.collector.update(window=_window(ranked))
    labels = {"run": "t", "rank": "0"}
    order = {s.kernel: ex.registry.get_sample_value(M.SUGGESTION_ORDER, {**labels, "kernel": s.kernel})
             for s in ranked}
    gain = {s.kernel: ex.registry.get_sample_value(M.SUGGESTION_EXPECTED_GAIN, {**labels, "kernel": s.kernel})
            for s in ranked}
    assert order == {"torch_compile": 1.0, "fused_adamw": 2.0, "rms_norm": 3.0}
    assert gain == {"torch_compile": 0.05, "fused_adamw": 0.02, "rms_norm": 0.123}
    # what the rule's query (gain and on(kernel) bottomk(1, order)) selects: the engine's {suggestion}
    first = min(order, key=order.get)
    assert (first, gain[first]) == ("torch_compile", 0.05) and max(gain, key=gain.get) == "rms_norm"


def test_a_window_without_suggestions_has_no_suggestion_series():
    from prometheus_client import generate_latest

    ex = Exporter(RunInfo(run="t"))
    ex.collector.update(window=_window([]))
    text = generate_latest(ex.registry).decode()
    assert M.MEMORY_BOUND_SHARE + "{" in text  # the window was exported
    assert M.SUGGESTION_ORDER + "{" not in text and M.SUGGESTION_EXPECTED_GAIN + "{" not in text
