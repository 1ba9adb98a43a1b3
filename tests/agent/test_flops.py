"""FLOP model: the analytic PaLM formula against FlopCounterMode, and the CPU SDPA formula."""

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from mfuwatch.agent.demo import DemoLM, DemoShape
from mfuwatch.agent.flops.counter import ensure_cpu_sdpa_flop_formulas, split_model_hardware
from mfuwatch.agent.flops.model import analytic_flops_per_token, count_matmul_params


def test_analytic_formula_hand_value():
    # N=1000, L=2, d=16, T=8: 6*1000 + 12*2*16*8 = 6000 + 3072
    assert analytic_flops_per_token(1000, 2, 16, 8) == 9072.0


def test_fixture_llama_flops_match_trace_readme():
    # The H200 fixture's README gives 7,073,811,136,512 model FLOPs per step for its Llama
    # (V=32000, d=2048, L=4, ff=5632, B=4, T=1024). Its N: per layer 4 d^2 + 3 d ff, plus the head d V.
    d, L, ff, V, T, B = 2048, 4, 5632, 32000, 1024, 4
    n = L * (4 * d * d + 3 * d * ff) + d * V
    assert analytic_flops_per_token(n, L, d, T) * B * T == 6 * n * B * T + 12 * L * d * T * B * T


def test_count_matmul_params_excludes_embeddings_and_norms():
    s = DemoShape(vocab=50, d_model=16, n_layers=2, n_heads=2, d_ff=24, seq=8, batch=2)
    m = DemoLM(s)
    per_layer = 3 * 16 * 16 + 16 * 16 + 3 * 16 * 24
    assert count_matmul_params(m) == 2 * per_layer + 16 * 50


def test_cpu_sdpa_counts_after_registration():
    ensure_cpu_sdpa_flop_formulas()
    B, H, T, D = 2, 3, 16, 8
    q = torch.randn(B, H, T, D, requires_grad=True)
    with FlopCounterMode(display=False) as m:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    # forward QK^T and PV: 2 matmuls of 2 B H T T D each. The flash backward re-computes QK^T, then
    # dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q: 5 matmuls of 2 B H T T D each.
    mm = 2 * B * H * T * T * D
    assert m.get_total_flops() == 2 * mm + 5 * mm


def test_analytic_matches_flop_counter_within_2_percent():
    ensure_cpu_sdpa_flop_formulas()
    s = DemoShape(vocab=64, d_model=32, n_layers=2, n_heads=4, d_ff=88, seq=24, batch=3)
    torch.manual_seed(0)
    m = DemoLM(s)
    idx = torch.randint(0, s.vocab, (s.batch, s.seq))
    with FlopCounterMode(display=False) as fc:
        logits = m(idx)
        F.cross_entropy(logits.view(-1, s.vocab), idx.view(-1)).backward()
    measured = fc.get_total_flops()
    analytic = analytic_flops_per_token(count_matmul_params(m), s.n_layers, s.d_model, s.seq) * s.batch * s.seq
    assert abs(measured - analytic) / analytic < 0.02


def test_split_model_hardware():
    # no recomputation: executed = 3 x forward
    assert split_model_hardware(300, 100) == (300.0, 300.0)
    # checkpointing re-ran the forward: executed = 4 x forward; model FLOPs exclude it
    assert split_model_hardware(400, 100) == (300.0, 400.0)
    # frozen weights (no dW): executed < 3 x forward, model = executed
    assert split_model_hardware(250, 100) == (250.0, 250.0)


def test_activation_checkpointing_detection_and_hfu_share():
    from mfuwatch.agent.flops.model import uses_activation_checkpointing

    class New(torch.nn.Module):  # transformers 5 spelling
        is_activation_checkpointing = True

    class Old(torch.nn.Module):  # transformers 4 spelling
        is_gradient_checkpointing = True

    assert uses_activation_checkpointing(New()) and uses_activation_checkpointing(Old())
    assert not uses_activation_checkpointing(torch.nn.Linear(2, 2)) and not uses_activation_checkpointing(None)
