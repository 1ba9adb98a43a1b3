"""What the callbacks share (agent/integrations/_common.py), and lazy framework imports."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mfuwatch.agent.config import AgentConfig, ConfigError
from mfuwatch.agent.integrations import _common


@pytest.mark.parametrize("batch, expected", [
    ({"input_ids": torch.zeros(4, 16, dtype=torch.long), "attention_mask": torch.zeros(4, 16)}, 64),  # padding counts
    ({"labels": torch.zeros(3, 7, dtype=torch.long), "inputs_embeds": torch.zeros(3, 7, 32)}, 21),
    ((torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9, dtype=torch.long)), 18),  # (x, y) tuple
    ([torch.zeros(5, 3, 32, 32), torch.zeros(5, dtype=torch.long)], 5),  # images: samples
    (torch.zeros(6, 11, dtype=torch.long), 66),
    ({"text": ["no tensors"]}, 0),
])
def test_tokens_in_batch(batch, expected):
    assert _common.tokens_in_batch(batch) == expected


def test_build_config_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    monkeypatch.delenv("MFUWATCH_RUN", raising=False)
    facts = {"rank": 3, "local_rank": 1, "world_size": 4, "dtype": "bf16", "run": "from-framework", "model_shape": None}
    # framework facts fill what nobody set
    cfg = _common.build_config(None, {}, facts)
    assert (cfg.rank, cfg.local_rank, cfg.world_size, cfg.dtype, cfg.run) == (3, 1, 4, "bf16", "from-framework")
    assert cfg.model_shape is None
    # a YAML file beats the framework; keyword overrides beat the file
    p = tmp_path / "agent.yaml"
    p.write_text("dtype: fp16\nrun: from-file\nport: 9600\n")
    cfg = _common.build_config(str(p), {"run": "from-kwargs"}, facts)
    assert (cfg.dtype, cfg.run, cfg.port, cfg.rank) == ("fp16", "from-kwargs", 9600, 3)
    # $MFUWATCH_CONFIG is read when no config is given
    monkeypatch.setenv("MFUWATCH_CONFIG", str(p))
    assert _common.build_config(None, {}, facts).run == "from-file"
    # an AgentConfig is taken whole
    mine = AgentConfig(run="obj", rank=0, world_size=1, dtype="fp32")
    cfg = _common.build_config(mine, {}, facts)
    assert (cfg.run, cfg.rank, cfg.dtype) == ("obj", 0, "fp32")


def test_build_config_fails_fast_naming_the_field(monkeypatch):
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    with pytest.raises(ConfigError, match="report_evry_steps.*report_every_steps"):
        _common.build_config({"report_evry_steps": 5}, {}, {})
    with pytest.raises(ConfigError, match="dtype"):
        _common.build_config(None, {"dtype": "int4"}, {})


def test_default_run_name_fills_an_empty_run(monkeypatch):
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    monkeypatch.delenv("MFUWATCH_RUN", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "myjob")
    assert _common.build_config(None, {}, {"run": None}).run == "torchrun-myjob"


def test_mark_gap_uses_the_agent_method_when_present():
    class Old:
        pass

    class New:
        calls = 0

        def mark_gap(self):
            New.calls += 1

    _common.mark_gap(Old())  # no method: nothing happens, nothing raised
    _common.mark_gap(New())
    assert New.calls == 1


def test_apply_kernel_patch_without_a_patch_function(monkeypatch, caplog):
    import types

    monkeypatch.setitem(sys.modules, "mfuwatch.kernels", types.ModuleType("mfuwatch.kernels"))  # no patch()
    with caplog.at_level("WARNING", logger="mfuwatch"):
        assert _common.apply_kernel_patch(torch.nn.Linear(2, 2), True) is None
    assert any("patch_kernels requested" in r.getMessage() for r in caplog.records)


def test_installing_mfuwatch_never_imports_the_frameworks():
    code = ("import sys, mfuwatch.agent, mfuwatch.agent.integrations, mfuwatch.agent.distributed, "
            "mfuwatch.agent.integrations._common\n"
            "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning', 'accelerate', 'torch') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"  # not even torch: the integration helpers are light until used
