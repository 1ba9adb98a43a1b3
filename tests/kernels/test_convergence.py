"""Convergence check: a small Hugging Face Llama trained on real text with every kernel patched follows the
unpatched loss curve.

The model (from a config, no download) learns bytes of the Gettysburg Address (public domain,
``tests/fixtures/text/gettysburg.txt``) for 100 AdamW steps on the CPU, once as Hugging Face wrote it
and once after ``mfuwatch.kernels.patch(model)`` (RMSNorm, SwiGLU and rotary on the Triton kernels, run
by the interpreter), from the same initial weights and on the same batches. In fp32 the two differ by
rounding only (the kernels round once where PyTorch rounds after each op), so the curves must agree to
a small fraction of the loss while both fall well below their start.
"""

import copy
from pathlib import Path

import pytest
import torch

import mfuwatch.kernels as mk
from tests.helpers.kernel_checks import DEVICE

transformers = pytest.importorskip("transformers")

TEXT = Path(__file__).resolve().parents[1] / "fixtures" / "text" / "gettysburg.txt"
STEPS, BATCH, SEQ = 100, 2, 16
#: largest allowed |patched - unpatched| loss at any step, in nats (the loss starts at ln 256 = 5.5)
TOLERANCE = 0.02


def batches():
    data = torch.tensor(list(TEXT.read_bytes()), dtype=torch.long)  # byte-level tokens: vocabulary 256
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, data.numel() - SEQ - 1, (STEPS, BATCH), generator=gen)
    return [torch.stack([data[s:s + SEQ] for s in row.tolist()]).to(DEVICE) for row in starts]


def train(model, data):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # a host sync per step: fine on the CPU
    return torch.tensor(losses)


@pytest.mark.slow
def test_patched_llama_follows_the_unpatched_loss_curve():
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64, vocab_size=256,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(cfg).to(DEVICE)
    patched = copy.deepcopy(reference)
    report = mk.patch(patched)
    # every kernel with a module pattern in a Llama: 2 x 2 + 1 norms, 2 MLPs, 2 attention modules
    assert (report.count("rms_norm"), report.count("swiglu"), report.count("rotary")) == (5, 2, 2), str(report)
    data = batches()
    ref_losses = train(reference, data)
    losses = train(patched, data)
    assert ref_losses[-10:].mean() < 0.6 * ref_losses[0], ref_losses  # it learns the text
    gap = (losses - ref_losses).abs()
    print(f"largest loss gap {float(gap.max()):.2e} nats (tolerance {TOLERANCE})")
    assert float(gap.max()) <= TOLERANCE, f"largest gap {float(gap.max()):.4f} at step {int(gap.argmax())}"
