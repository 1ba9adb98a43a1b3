"""Dense matmul FLOPs without torch: the same count as torch's formulas, and `mfuwatch analyze` of a
transformer trace never imports torch (its import alone is about 380 MB of the 300 MB budget)."""

from __future__ import annotations

import subprocess
import sys

from mfuwatch.agent.analysis import opcost
from mfuwatch.agent.analysis.trace import read_trace
from tests.helpers.traces import TRACES

DENSE = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _torch_count(name, dims, types, concrete):
    """torch.utils.flop_counter's own formula on the recorded shapes (the independent reference)."""
    from torch.utils.flop_counter import flop_registry
    import torch

    args = []
    for i, t in enumerate(types):
        if t in opcost._NON_TENSOR:
            args.append(opcost._literal(concrete[i]) if i < len(concrete) else None)
        else:
            args.append(tuple(int(x) for x in dims[i]))
    packet = getattr(torch.ops.aten, name.split("::")[1])
    fn = flop_registry.get(packet) or flop_registry[packet.default]
    a, b = (args[1], args[2]) if name in ("aten::addmm", "aten::baddbmm") else (args[0], args[1])
    out = (*a[:-1], b[-1])
    return fn(*args[:3 if name in ("aten::addmm", "aten::baddbmm") else 2], out_val=out)


def test_dense_matmul_flops_equal_torchs_formula_on_every_matmul_of_the_real_traces():
    seen = {n: 0 for n in DENSE}
    for trace in ("llama_bf16_eager.json.gz", "gpt_bf16_input_stall.json.gz"):
        for e in read_trace(str(TRACES / trace)).events():
            name = e.get("name")
            if e.get("cat") != "cpu_op" or name not in DENSE:
                continue
            a = e.get("args", {})
            dims, types, concrete = a.get("Input Dims"), a.get("Input type"), a.get("Concrete Inputs") or []
            cost = opcost.op_cost(name, dims, types, concrete)
            assert cost.flops == _torch_count(name, dims, types, concrete), (name, dims)
            seen[name] += 1
    assert seen["aten::mm"] > 100 and seen["aten::addmm"] + seen["aten::bmm"] > 0, seen


def test_hand_counts():
    assert opcost._dense_matmul_flops("aten::mm", [(3, 5), (5, 7)]) == 2 * 3 * 5 * 7
    assert opcost._dense_matmul_flops("aten::baddbmm", [(4, 3, 7), (4, 3, 5), (4, 5, 7), 1, 1]) == 2 * 4 * 3 * 5 * 7
    assert opcost._dense_matmul_flops("aten::mm", [(3, 5), (6, 7)]) is None  # not a matmul shape: torch decides


def test_analyze_of_a_transformer_trace_imports_no_torch():
    code = ("import sys; from mfuwatch.agent.analysis.analyze import main; "
            f"rc = main([{str(TRACES / 'llama_bf16_eager.json.gz')!r}, '--json', '--output', '/dev/null']); "
            "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["0", "False"], out.stdout + out.stderr
