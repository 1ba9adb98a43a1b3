"""A stand-in kernel for tests/kernels/test_kernel_list.py: ``double(x) = 2 x`` with its facts and a swap rule.

Not a Triton kernel: it exists to be registered in ``mfuwatch.kernels._KERNELS`` by the test and found in
every view derived from the kernel list.
"""

import torch
from torch import nn

from mfuwatch.kernels import _flops
from mfuwatch.kernels._facts import Bytes, KernelFacts, Remedy, Step, aten, patch_line
from mfuwatch.kernels._patch_types import Candidate


@torch.library.custom_op("mfuwatch_test::double", mutates_args=())
def _double_op(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_double_op.register_fake
def _(x):
    return torch.empty_like(x)


FACTS = KernelFacts(
    name="fake_double",
    forward=Bytes(activations=2), backward=Bytes(activations=2, weights=1),  # read x, write y; a made-up weight
    flops={"forward": 1, "backward": 1},
    remedy=Remedy(kernel="fake_double", kind="bundled", title="Fused doubling", apply=patch_line("fake_double"),
                  replaces="add(x, x)", sequence=(Step(aten("add")),)),
    exports=("double", "Doubler"),
    patch="tests.kernels.fake_kernel",
)

_flops.register(torch.ops.mfuwatch_test.double,
                lambda x, out_shape=None, **kw: _flops.numel(x) * FACTS.flops["forward"])


def double(x: torch.Tensor) -> torch.Tensor:
    """``2 x`` through the stand-in's custom op."""
    return torch.ops.mfuwatch_test.double(x)


class Doubler(nn.Module):
    """The stand-in's drop-in: ``2 x``, with the weight of the module it replaces."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return double(x)


class UserDoubler(nn.Module):
    """The module the swap rule recognises: ``x + x``, with an unused weight (for device and dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x + x


def swap_candidate(m: nn.Module):
    """A :class:`UserDoubler` becomes a :class:`Doubler`; None for other modules."""
    if not isinstance(m, UserDoubler):
        return None
    return Candidate("fake_double", [lambda: Doubler(m.weight)], probe_shape=(4, 3))
