"""benchmarks/_memory_peak.py: the replay of an allocator trace finds the peak and what is alive there."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "_memory_peak.py"


def _module():
    spec = importlib.util.spec_from_file_location("_memory_peak", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _frames(*where):
    return [{"filename": f, "line": ln, "name": n} for f, ln, n in where]


import torch

TORCH = (str(Path(torch.__file__).resolve().parent / "nn" / "functional.py"), 10, "linear")
HEAD = ("/repo/kernels/linear_cross_entropy.py", 215, "_chunked")
BODY = ("/site/transformers/models/llama/modeling_llama.py", 88, "forward")


def _ev(action, addr, size, *where):
    return {"action": action, "addr": addr, "size": size, "frames": _frames(*where)}


def test_the_peak_is_the_highest_running_total_and_its_blocks_are_grouped_by_allocating_line():
    m = _module()
    trace = [
        _ev("segment_alloc", 0, 1 << 30),          # segment actions do not change what is allocated
        _ev("alloc", 1, 100, TORCH, BODY),         # the body: 100 + 50 alive throughout
        _ev("alloc", 2, 50, BODY),
        _ev("alloc", 3, 400, TORCH, HEAD),         # a first chunk, freed before the second
        _ev("free_requested", 3, 400),
        _ev("free_completed", 3, 400),             # counted once, at the request
        _ev("alloc", 4, 300, HEAD),                # 100 + 50 + 300 + 70 = 520 here: below the 550
        _ev("alloc", 5, 70, HEAD),                 # (100 + 50 + 400) reached at block 3
        _ev("free_completed", 9, 1000),            # an older block (before the trace): the total drops
        _ev("alloc", 6, 10, BODY),
    ]
    above, rows = m.peak_breakdown(trace)
    assert above == 550  # after event 3: blocks 1, 2, 3
    assert rows == [(400, 1, "kernels/linear_cross_entropy.py:215 _chunked"),
                    (150, 2, "llama/modeling_llama.py:88 forward")]


def test_a_later_higher_point_wins_and_the_rest_folds_into_other():
    m = _module()
    trace = [_ev("alloc", i, 10 * (i + 1), (f"/a/f{i}.py", i, "g")) for i in range(5)]
    trace.insert(2, _ev("free_requested", 0, 10))  # 10 freed early: the peak is the end, 140 = 150 - 10
    above, rows = m.peak_breakdown(trace, top=2)
    assert above == 20 + 30 + 40 + 50
    assert rows == [(50, 1, "a/f4.py:4 g"), (40, 1, "a/f3.py:3 g"), (50, 2, "other (2 sites)")]


def test_site_skips_torch_frames_and_names_a_frameless_block():
    m = _module()
    assert m.site(_frames(TORCH, ("<frozen importlib>", 1, "x"), HEAD)) == "kernels/linear_cross_entropy.py:215 _chunked"
    assert m.site([]) == "?"
    # an environment under a folder named torch: its other packages are not torch's own
    venv = ("/opt/torch/lib/python3.12/site-packages/liger_kernel/ops/x.py", 7, "f")
    assert m.site(_frames(("/opt/torch/lib/python3.12/site-packages/torch/nn/f.py", 1, "g"), venv),
                  torch_dir="/opt/torch/lib/python3.12/site-packages/torch/") == "ops/x.py:7 f"
