"""MemoryBoundDominant names a drop-in no other suggested fix covers, or says which fix covers it (issue 24).

The live window proposes a set: a bundled drop-in whose ops ``torch.compile`` fuses too is ``covered_by``
``torch_compile`` with a gain in the set of 0. The alert used to append the first bundled suggestion whatever
its coverage, telling the user to apply a drop-in the first fix already made redundant.
"""

from __future__ import annotations

from mfuwatch.agent.schema import Suggestion, WindowMeasurement
from mfuwatch.alerts.notifiers.console import fixes_of
from mfuwatch.alerts.notifiers.text import fix_line
from mfuwatch.alerts.signals import suggestion_rows
from tests.alerts.test_alert_engine import engine_with

CFG = {"rules": {"MemoryBoundDominant": {"threshold": 0.4, "for": "0s"}}}


def _sugg(kernel, gain, kind, covered_by=None, in_set=None):
    apply = 'model = torch.compile(model)' if kernel == "torch_compile" else \
        f'mfuwatch.kernels.patch(model, kernels=["{kernel}"])'
    return Suggestion(kernel, kernel, apply, ["aten::mul"], 0.01, gain, kind,
                      gain_in_set=gain if in_set is None else in_set, covered_by=covered_by)


def _window(*suggestions):
    return WindowMeasurement(step=1, timestamp=0, steps=3, wall_seconds=1, busy_seconds=1, breakdown={"idle": 0.0},
                             memory_bound_share=0.7, suggestions=list(suggestions))


def _fired(run_info, clock, window):
    e, cap, _, _ = engine_with(CFG, run_info, clock)
    e.observe_window(window)
    e.evaluate()
    (alert,) = [a for n in cap.sent for a in n.alerts if a.name == "MemoryBoundDominant"]
    return alert


# the Qwen3 window of docs/gpu-runs/gain_truth-run3.md, shortened: compile first, the drop-ins it covers, and
# one it does not (a hypothetical norm outside the compiled model)
COMPILE = _sugg("torch_compile", 0.264, "existing")
ADAMW = _sugg("fused_adamw", 0.074, "existing")
GRAPHS = _sugg("cuda_graphs", 0.055, "existing", covered_by="torch_compile", in_set=0.0)
RMS = _sugg("rms_norm", 0.152, "bundled", covered_by="torch_compile", in_set=0.0)
CE = _sugg("cross_entropy", 0.099, "bundled", covered_by="torch_compile", in_set=0.0)
LN = _sugg("layer_norm", 0.012, "bundled")


def test_the_drop_in_named_is_one_no_suggested_fix_covers(run_info, clock):
    w = _window(COMPILE, ADAMW, GRAPHS, RMS, CE, LN)
    assert [r["kernel"] for r in suggestion_rows(w)] == ["torch_compile", "fused_adamw", "cuda_graphs", "layer_norm"]
    a = _fired(run_info, clock, w)
    assert a.annotations["bundled_kernel"] == "layer_norm" and "bundled_covered_by" not in a.annotations
    assert [f["kernel"] for f in fixes_of(a)] == ["torch_compile", "layer_norm"]
    assert "covered" not in fix_line(fixes_of(a)[1])
    assert "cuda_graphs [existing]: " in a.annotations["suggestions"]
    assert "; covered by torch_compile (in the set it adds 0.0%)" in a.annotations["suggestions"]


def test_when_every_drop_in_is_covered_the_alert_says_by_which_fix(run_info, clock):
    w = _window(COMPILE, ADAMW, GRAPHS, RMS, CE)
    a = _fired(run_info, clock, w)
    assert a.annotations["bundled_kernel"] == "rms_norm" and a.annotations["bundled_covered_by"] == "torch_compile"
    shown = fixes_of(a)
    assert [f["kernel"] for f in shown] == ["torch_compile", "rms_norm"]
    assert fix_line(shown[1]) == ('rms_norm: mfuwatch.kernels.patch(model, kernels=["rms_norm"])  (expected gain '
                                  '15.2% of step time)  (covered by torch_compile, already suggested)')
