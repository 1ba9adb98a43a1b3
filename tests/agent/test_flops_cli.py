"""``mfuwatch flops``: a config file in, the per-component table and the counted value out; never a download."""

import pytest

transformers = pytest.importorskip("transformers")

from mfuwatch.agent.flops import cli as flops_cli  # noqa: E402


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
    err = capsys.readouterr().err
    assert "'nobody/no-such-model' is not a file or folder here, and not in the local Hugging Face cache" in err
    assert "never downloads" in err and "mfuwatch flops path/to/config.json" in err
    assert "internet connection" not in err and err.count("\n") == 1, err  # one line, not transformers' advice


def test_a_missing_json_file_says_so(tmp_path, capsys):
    assert flops_cli.main([str(tmp_path / "config.json")]) == 1
    assert capsys.readouterr().err == f"mfuwatch flops: {tmp_path / 'config.json'}: no such file or folder\n"
    assert flops_cli.main([str(tmp_path / "model")]) == 1
    assert capsys.readouterr().err == f"mfuwatch flops: {tmp_path / 'model'}: no such file or folder\n"


def test_an_unknown_model_type_names_the_closest_ones(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "lama", "hidden_size": 32}')
    assert flops_cli.main([str(path)]) == 1
    err = capsys.readouterr().err
    assert "model_type 'lama' is not one this transformers" in err and "closest: llama" in err
    assert "mfuwatch flops --list-model-types" in err
    assert len(err) < 300 and "gpt-sw3" not in err, err  # not transformers' list of hundreds
    for where in (tmp_path,):  # a model folder is checked the same way
        assert flops_cli.main([str(where)]) == 1
        assert "closest: llama" in capsys.readouterr().err
    assert flops_cli.main(["--list-model-types"]) == 0
    listed = capsys.readouterr().out.split()
    assert "llama" in listed and "t5" in listed and listed == sorted(listed)


def _total_line(out):
    return float(next(x for x in out.splitlines() if x.startswith("total (model)")).split()[-1])


@pytest.mark.parametrize("max_pos, expected_t, why", [
    (64, 64, "sequence length 64 (the config's max_position_embeddings, below the default 2048;"),
    (4096, 2048, "sequence length 2048 (the default;"),
])
def test_default_seq_len_is_capped_by_max_position_embeddings(tmp_path, capsys, max_pos, expected_t, why):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos)
    path = tmp_path / "config.json"
    cfg.to_json_file(str(path))
    assert flops_cli.main([str(path)]) == 0
    out = capsys.readouterr().out
    d, ff, v, L, T = 32, 48, 64, 2, expected_t
    n = L * (2 * d * d + 2 * d * 16 + 3 * d * ff) + v * d
    assert _total_line(out) == pytest.approx(6 * n * T + 12 * L * d * T * T, rel=1e-3)
    assert why in out
    assert out.splitlines()[0] == f"LlamaForCausalLM (decoder, model_type llama), 1 sequence of {T} tokens"
    assert "Lengths(" not in out


def test_an_explicit_seq_len_above_the_config_limit_is_used_and_flagged(tmp_path, capsys):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, max_position_embeddings=64)
    path = tmp_path / "config.json"
    cfg.to_json_file(str(path))
    assert flops_cli.main([str(path), "--seq-len", "100", "--batch", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 sequences of 100 tokens" in out
    assert "sequence length 100 (from --seq-len, above the config's max_position_embeddings 64)" in out


def test_encoder_decoder_lengths_in_words(tmp_path, capsys):
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_ff=48, num_layers=1, num_heads=2, d_kv=16)
    path = tmp_path / "config.json"
    cfg.to_json_file(str(path))
    assert flops_cli.main([str(path), "--seq-len", "16", "--source-len", "32"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("1 sequence of 32 encoder and 16 decoder tokens")
    assert out[1] == "decoder length 16 (from --seq-len)"


def test_bad_arguments_name_the_option(tmp_path):
    with pytest.raises(SystemExit):
        flops_cli.main([str(_llama_config(tmp_path)), "--batch", "0"])
