"""``mfuwatch flops``: a config file in, the per-component table and the counted value out; never a download."""

import pytest

transformers = pytest.importorskip("transformers")

from mfuwatch.agent import flops_cli  # noqa: E402


def _llama_config(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path / "config.json"
    cfg.to_json_file(str(path))
    return path


def test_breakdown_and_count_of_a_config_file(tmp_path, capsys):
    path = _llama_config(tmp_path)
    assert flops_cli.main([str(path), "--seq-len", "16", "--batch", "2", "--count"]) == 0
    out = capsys.readouterr().out
    d, ff, v, L, T, B = 32, 48, 64, 2, 16, 2
    n = L * (2 * d * d + 2 * d * 16 + 3 * d * ff) + v * d  # q, o; k, v (2 KV heads of 8); MLP; head
    total = 6 * n * B * T + 12 * L * d * T * B * T
    line = next(x for x in out.splitlines() if x.startswith("total (model)"))
    assert float(line.split()[-1]) == pytest.approx(total, rel=1e-3)
    assert "ratio 1.000" in out and "untracked ops (counted 0): none" in out
    for comp in ("attention projections", "mlp", "head", "attention scores", "frozen share"):
        assert comp in out


def test_a_model_id_not_in_the_cache_fails_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert flops_cli.main(["nobody/no-such-model"]) == 1
    assert "local files only, no download" in capsys.readouterr().err


def test_bad_arguments_name_the_option(tmp_path):
    with pytest.raises(SystemExit):
        flops_cli.main([str(_llama_config(tmp_path)), "--batch", "0"])
