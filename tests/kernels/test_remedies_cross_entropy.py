"""The cross-entropy suggestion: a bundled drop-in whose minimal bytes are the loss kernel's traffic."""

from mfuwatch.kernels import traffic
from tests.kernels.test_remedies import by_kernel


def test_cross_entropy_entry_is_the_bundled_drop_in():
    r = by_kernel("cross_entropy")
    assert r.bundled and r.apply == 'mfuwatch.kernels.patch(model, kernels=["cross_entropy"])'
    ops = {op for step in r.sequence for op in step.ops}
    assert {"aten::log_softmax", "aten::nll_loss", "aten::cross_entropy_loss"} <= ops
    assert "mfuwatch.kernels.cross_entropy(logits, targets)" in r.note


def test_minimal_bytes_read_forward_read_and_write_backward():
    rows, vocab = 8192, 128256
    e = rows * vocab
    r = by_kernel("cross_entropy")
    # bf16 logits: forward reads them once (2 B), backward reads them and writes the gradient (4 B)
    assert r.minimal_bytes(e, vocab, 2, backward=False) == e * 2
    assert r.minimal_bytes(e, vocab, 2, backward=True) == e * 2 + 2 * e * 2
    assert traffic.minimal_bytes("cross_entropy", rows, vocab, 4, backward=True) == 2 * e * 4
