"""Config validation: bad values and unknown keys fail fast, naming the field and what is accepted."""

import pytest

from mfuwatch.agent.config import ConfigError, ProfileEvery, load_config, parse_profile_every


def test_defaults_and_env(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    cfg = load_config()
    assert (cfg.rank, cfg.local_rank, cfg.world_size) == (3, 1, 8)
    assert cfg.port == 9478 and cfg.bind == "127.0.0.1"
    assert cfg.profile_every == ProfileEvery(seconds=300.0)
    assert cfg.run  # a default run label is filled in


def test_unknown_key_names_nearest():
    with pytest.raises(ConfigError, match=r"prot: unknown setting \(did you mean 'port'\?\)"):
        load_config(prot=9000)


def test_bad_dtype_lists_accepted():
    with pytest.raises(ConfigError, match=r"dtype: expected one of fp32, tf32, bf16, fp16, fp8"):
        load_config(dtype="float32")


@pytest.mark.parametrize("value, expected", [
    ("500 steps", ProfileEvery(steps=500)),
    ("300s", ProfileEvery(seconds=300.0)),
    ("5 min", ProfileEvery(seconds=300.0)),
    ("1h", ProfileEvery(seconds=3600.0)),
    (20, ProfileEvery(steps=20)),
    ("off", ProfileEvery()),
    (0, ProfileEvery()),
])
def test_profile_every_forms(value, expected):
    assert parse_profile_every(value) == expected


@pytest.mark.parametrize("bad", ["often", "-3 steps", "2.5 steps", True, -1])
def test_profile_every_rejects(bad):
    with pytest.raises(ConfigError, match="profile_every"):
        parse_profile_every(bad)


def test_yaml_file_and_override_precedence(tmp_path):
    p = tmp_path / "mfuwatch.yaml"
    p.write_text("port: 9500\nrun: from-file\nmodel_shape: {n_layers: 2, d_model: 64}\n")
    cfg = load_config(p, run="from-kwargs")
    assert cfg.port == 9500 and cfg.run == "from-kwargs"
    assert cfg.model_shape.n_layers == 2 and cfg.model_shape.d_model == 64


def test_env_config_path(tmp_path, monkeypatch):
    p = tmp_path / "c.yaml"
    p.write_text("report_every_steps: 3\n")
    monkeypatch.setenv("MFUWATCH_CONFIG", str(p))
    assert load_config().report_every_steps == 3


def test_yaml_errors_name_the_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("port: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    p.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(p)


@pytest.mark.parametrize("kw, field", [
    ({"port": 70000}, "port"),
    ({"port": "9000"}, "port"),
    ({"peak_flops": -1.0}, "peak_flops"),
    ({"flops_per_step": 0}, "flops_per_step"),
    ({"report_every_steps": 0}, "report_every_steps"),
    ({"nvml_interval_seconds": 0.0}, "nvml_interval_seconds"),
    ({"calibrate": "yes"}, "calibrate"),
    ({"model_shape": {"n_layers": 2}}, "model_shape.d_model"),
    ({"model_shape": {"n_layers": 2, "d_model": 8, "hidden": 3}}, "model_shape.hidden"),
    ({"tls_certfile": "/nonexistent.pem"}, "tls_certfile"),
    ({"rank": 4, "world_size": 2}, "rank/world_size"),
    ({"alerts": 3}, "alerts"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ConfigError) as ei:
        load_config(**kw)
    assert str(ei.value).startswith(field)


def test_bad_env_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "zero")
    with pytest.raises(ConfigError, match="LOCAL_RANK"):
        load_config()


def test_default_run_is_shared_by_the_ranks_of_a_torchrun_job(monkeypatch):
    monkeypatch.delenv("MFUWATCH_RUN", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert load_config().run == "torchrun-0f1e2d3c"


def test_file_sd_dir_must_be_a_path():
    with pytest.raises(ConfigError, match="file_sd_dir"):
        load_config(file_sd_dir=3)


def test_command_line_forms_are_accepted(tmp_path):
    # "500" as a command line passes it, and YAML 1.1 reads 1e12 (no dot) as a string
    assert load_config(profile_every="500").profile_every == ProfileEvery(steps=500)
    p = tmp_path / "c.yaml"
    p.write_text("peak_flops: 1e12\n")
    assert load_config(p).peak_flops == 1e12


def test_unresolvable_bind_fails_fast():
    with pytest.raises(ConfigError, match="bind: cannot resolve"):
        load_config(bind="not a host")


def test_alerts_path_is_relative_to_the_config_file(tmp_path, monkeypatch):
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "agent.yaml").write_text("alerts: rules.yaml\n")
    monkeypatch.chdir(tmp_path)
    assert load_config(sub / "agent.yaml").alerts == str(sub / "rules.yaml")
