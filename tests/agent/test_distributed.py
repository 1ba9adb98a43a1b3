"""Rank identity, the shared run name, file-based service discovery and the scrape configs.

The end-to-end check runs a real Prometheus (Debian package ``prometheus``, installed when missing) on
127.0.0.1 with the scrape config this module renders, and two agents labelled rank 0 and rank 1 that register
themselves through file-SD files: Prometheus finds both, stores their series with the right ``rank`` labels,
and drops a rank's target when its file is removed.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml
from tests.helpers.debian_tools import ensure_binary
from tests.helpers.integration_fixtures import install_fake_clock
from tests.helpers.net import free_port

from mfuwatch.agent import Agent
from mfuwatch.agent import distributed as d

BASE = dict(nvml=False, alerts=False, profile_every="off", report_every_steps=1000)


def test_rank_from_torchrun_environment():
    assert d.rank_from_env({"RANK": "11", "LOCAL_RANK": "3", "WORLD_SIZE": "16", "GROUP_RANK": "1"}) == (11, 3, 16)
    assert d.rank_from_env({}) == (0, 0, 1)
    assert d.rank_from_env({"RANK": "", "LOCAL_RANK": "", "WORLD_SIZE": ""}) == (0, 0, 1)  # empty = unset


@pytest.mark.parametrize("env, name", [({"RANK": "x"}, "RANK"), ({"LOCAL_RANK": "-1"}, "LOCAL_RANK"),
                                       ({"WORLD_SIZE": "0"}, "WORLD_SIZE"), ({"WORLD_SIZE": "2.5"}, "WORLD_SIZE")])
def test_malformed_rank_environment_is_one_error_naming_the_variable(env, name):
    with pytest.raises(ValueError, match=name):
        d.rank_from_env(env)


def test_run_name_reads_world_size_through_the_rank_reader():
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        d.default_run_name({"WORLD_SIZE": "two", "MASTER_ADDR": "n0"})
    assert d.default_run_name({"WORLD_SIZE": "2", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}) == "job-n0-29500"


def test_exporter_port_is_base_plus_local_rank():
    assert [d.exporter_port(9478, r) for r in range(8)] == list(range(9478, 9486))
    assert d.exporter_port(0, 5) == 0  # any free port
    with pytest.raises(ValueError, match="65535"):
        d.exporter_port(65530, 7)


@pytest.mark.parametrize("env, expected", [
    ({"MFUWATCH_RUN": "mine", "TORCHELASTIC_RUN_ID": "abc"}, "mine"),
    ({"TORCHELASTIC_RUN_ID": "3f2a9c1e-0b4d-4e5f-8a6b-7c8d9e0f1a2b"}, "torchrun-3f2a9c1e"),
    ({"TORCHELASTIC_RUN_ID": "llama-70b/sft"}, "torchrun-llama-70b-sft"),
    ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "4242"}, "slurm-4242"),
    ({"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "16", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"},
     "job-node01-29500"),
])
def test_default_run_name_is_the_same_on_every_rank(env, expected):
    for rank in range(3):
        assert d.default_run_name({**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}) == expected


def test_default_run_name_of_a_single_process():
    import os

    assert d.default_run_name({}) == f"{socket.gethostname()}-{os.getpid()}"
    assert d.default_run_name({"WORLD_SIZE": "1", "MASTER_ADDR": "x"}) == f"{socket.gethostname()}-{os.getpid()}"


def test_file_sd_target_document_and_lifecycle(tmp_path):
    t = d.FileSDTarget(tmp_path / "sd", run="llama/70b run", rank=12, url="http://127.0.0.1:9482/metrics",
                       host="node02.cluster", labels={"cluster": "a"})
    path = t.write()
    assert path == tmp_path / "sd" / "llama_70b_run-rank12.json"
    assert json.loads(path.read_text()) == [{"targets": ["node02.cluster:9482"],
                                             "labels": {"__metrics_path__": "/metrics", "cluster": "a"}}]
    assert [p.name for p in (tmp_path / "sd").iterdir()] == [path.name]  # no temporary file left behind
    t.write()  # rewriting is fine
    t.remove()
    t.remove()  # idempotent
    assert not path.exists()


def test_file_sd_target_https_ipv6_and_label_clash(tmp_path):
    t = d.FileSDTarget(tmp_path, run="r", rank=0, url="https://[::1]:9478/metrics")
    assert t.document() == [{"targets": ["[::1]:9478"],
                             "labels": {"__metrics_path__": "/metrics", "__scheme__": "https"}}]
    with pytest.raises(ValueError, match="rank"):
        d.FileSDTarget(tmp_path, run="r", rank=0, url="http://h:1/metrics", labels={"rank": "0"})
    with pytest.raises(ValueError, match="no port"):
        d.FileSDTarget(tmp_path, run="r", rank=0, url="http://h/metrics")


def test_register_agent_counts_failures_instead_of_raising(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with Agent(config=dict(BASE, exporter=True, port=0, run="fail")) as a:
        assert d.register_agent(a, blocker / "sd") is None
        assert a.errors.get("file_sd") == 1
    with Agent(config=dict(BASE, exporter=False, run="noexp")) as a:
        assert d.register_agent(a, tmp_path) is None  # no exporter, nothing to discover
    assert list(tmp_path.iterdir()) == [blocker]


def test_advertised_host():
    assert d.advertised_host("127.0.0.1") == "127.0.0.1"
    assert d.advertised_host("10.1.2.3") == "10.1.2.3"
    assert d.advertised_host("0.0.0.0") == socket.getfqdn()


def test_static_pattern_for_n_nodes_by_8_ranks():
    cfg = d.scrape_config(hosts=["node01", "node02", "node03"], ranks_per_node=8)
    (job,) = cfg["scrape_configs"]
    assert job["honor_labels"] is True  # the series' job label (the training job) is kept, not renamed
    targets = job["static_configs"][0]["targets"]
    assert len(targets) == 24
    assert targets[:2] == ["node01:9478", "node01:9479"] and targets[7] == "node01:9485"
    assert targets[8] == "node02:9478" and targets[-1] == "node03:9485"
    with pytest.raises(ValueError, match="exactly one"):
        d.scrape_config(hosts=["a"], file_sd_dir="/x")
    with pytest.raises(ValueError, match="exactly one"):
        d.scrape_config()


def test_rendered_configs_pass_promtool(tmp_path, capsys):
    promtool = ensure_binary(["promtool"], "prometheus")
    for argv in (["--file-sd-dir", str(tmp_path / "targets")],
                 ["--hosts", "node01,node02", "--ranks-per-node", "8", "--scheme", "https"]):
        assert d.main(argv) == 0
        text = capsys.readouterr().out
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(text)
        res = subprocess.run([promtool, "check", "config", str(cfg)], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
    with pytest.raises(SystemExit) as exc:
        d.main(["--hosts", ",", "--ranks-per-node", "8"])
    assert exc.value.code == 2


def _api(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    return json.loads(urllib.request.urlopen(url, timeout=5).read().decode())["data"]


def _wait(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except OSError:
            pass
        time.sleep(0.25)
    return None


def _agent(rank: int, steps: int) -> Agent:
    a = Agent(config=dict(BASE, exporter=True, port=0, run="sd-e2e", job="train-42", rank=rank, local_rank=rank,
                          world_size=2, flops_per_step=1e9, peak_flops=1e10))
    now = install_fake_clock(a, start=True)
    for _ in range(steps):
        now.t += 0.5
        a.step(tokens=100)
    a.reporter.tick(final=False)
    return a


@pytest.mark.slow
def test_prometheus_discovers_every_rank_through_file_sd(tmp_path):
    prometheus = ensure_binary(["prometheus"], "prometheus")
    sd_dir = tmp_path / "targets"
    cfg = d.scrape_config("mfuwatch", file_sd_dir=str(sd_dir), scrape_interval="1s")
    cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    agents = [_agent(0, 4), _agent(1, 6)]
    targets = [d.register_agent(a, sd_dir) for a in agents]
    proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--log.level=warn"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def both_ranks():
            # the series' own job label (the training job) wins over the scrape job's name (honor_labels)
            res = _api(port, "query", query='mfuwatch_steps_total{job="train-42"}')["result"]
            return res if len(res) == 2 else None

        res = _wait(both_ranks)
        assert res, "Prometheus did not scrape both ranks"
        by_rank = {r["metric"]["rank"]: float(r["value"][1]) for r in res}
        assert by_rank == {"0": 4.0, "1": 6.0}
        assert all(r["metric"]["run"] == "sd-e2e" and "exported_rank" not in r["metric"]
                   and "exported_job" not in r["metric"] for r in res)
        instances = {r["metric"]["instance"] for r in res}
        assert instances == {t.target for t in targets}

        # rank 1 ends cleanly: its file goes, and Prometheus stops scraping it
        targets[1].remove()
        agents[1].close()

        def one_target():
            active = _api(port, "targets")["activeTargets"]
            return active if len(active) == 1 else None

        active = _wait(one_target)
        assert active and active[0]["scrapeUrl"] == agents[0].exporter_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        for a, t in zip(agents, targets):
            t.remove()
            a.close()


def test_end_process_group_frees_a_ddp_cycle_before_destroying_the_group(tmp_path, monkeypatch):
    """A DDP module kept alive only by a reference cycle is freed by the collection before the destroy (what
    the gloo exit abort needs, docs/fleet.md); afterwards no group is left, and a second call is a no-op."""
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    gc.disable()  # only end_process_group's own collection may free the cycle
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        ddp.loop = [ddp]  # a cycle: refcounting alone never frees it
        alive = weakref.ref(ddp)
        del ddp
        assert alive() is not None
        destroy, freed_at_destroy = dist.destroy_process_group, []
        monkeypatch.setattr(dist, "destroy_process_group",
                            lambda *a, **k: (freed_at_destroy.append(alive() is None), destroy(*a, **k)))
        d.end_process_group()
        assert freed_at_destroy == [True] and not dist.is_initialized()
        d.end_process_group()  # nothing initialized: returns without calling the destroy
        assert freed_at_destroy == [True]
    finally:
        gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()
