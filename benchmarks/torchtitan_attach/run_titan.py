"""Run ``torchtitan.train`` unmodified, without tensorboard installed (the validation run's harness).

torchtitan's metrics module imports ``torch.utils.tensorboard`` at import time even with tensorboard
off; the GPU machine has no tensorboard, so a stand-in module with no writer is registered first.
It also adds a flavor ``1B`` to torchtitan's Llama 3 table (the Llama 3.2 1B shape: dim 2048, 16
layers, 32 heads, 8 KV heads, FFN 8192, vocabulary 128256), which torchtitan 0.2.2 does not ship.
Everything else — model, parallelism, training loop, torchtitan's own tokens/s and MFU logging — is
torchtitan's own. Arguments are passed to torchtitan (``--job.config_file ...``).
"""

import runpy
import sys
import types

tb = types.ModuleType("torch.utils.tensorboard")
tb.SummaryWriter = None
sys.modules.setdefault("torch.utils.tensorboard", tb)

import torchtitan.models.llama3 as llama3  # noqa: E402
from torchtitan.models.llama3.model.args import TransformerModelArgs  # noqa: E402

llama3.llama3_args.setdefault("1B", TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                                                         ffn_dim_multiplier=1.5, multiple_of=256,
                                                         rope_theta=500000))
sys.argv = ["torchtitan.train"] + sys.argv[1:]
runpy.run_module("torchtitan.train", run_name="__main__")
