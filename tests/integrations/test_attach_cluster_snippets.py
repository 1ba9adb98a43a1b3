"""The cluster-wide snippets of ``mfuwatch run`` (docs/integrations.md, "Every job of a cluster"), run as written.

* Slurm: ``docs/examples/slurm/mfuwatch-task-prolog.sh`` is run as slurmstepd runs a TaskProlog (its
  ``export NAME=value`` stdout lines become the task's environment); ``srun-mfuwatch`` with a stand-in
  ``srun`` on ``PATH`` that runs its task. The task's Python must arm the bootstrap; the opt-outs must not.
* Kubernetes: ``docs/examples/kubernetes/mfuwatch-inject.yaml`` parses; the environment its policy gives a
  container, with the initContainer's ``--target`` directory laid out in a temporary directory, arms the
  bootstrap; the opt-out label is the one the docs name.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mfuwatch.agent.attach import bootstrap_dir

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "docs" / "examples" / "slurm"
K8S = ROOT / "docs" / "examples" / "kubernetes" / "mfuwatch-inject.yaml"
#: the task: prints whether the bootstrap armed the attacher once torch was imported
PROBE = ("import torch, mfuwatch.agent.attach.attacher as a; "
         "print('armed' if a._installed is not None and a._installed.state == 'armed' else 'off')")


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    for k in ("MFUWATCH_CONFIG", "MFUWATCH_DISABLE", "PYTHONPATH", "MFUWATCH_PYTHONPATH", "SLURM_JOB_ID"):
        env.pop(k, None)
    env.update(extra)
    return env


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def mfuwatch_cmd(tmp_path: Path) -> Path:
    """An ``mfuwatch`` command for this test's Python (the site's /opt/mfuwatch/bin/mfuwatch)."""
    return _executable(tmp_path / "mfuwatch", f'#!/bin/sh\nexec "{sys.executable}" -m mfuwatch.agent.cli "$@"\n')


@pytest.mark.parametrize("script", ["mfuwatch-task-prolog.sh", "srun-mfuwatch"])
def test_slurm_scripts_are_valid_bash(script):
    assert shutil.which("bash")
    p = subprocess.run(["bash", "-n", str(SLURM / script)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr


def _task_env_from_prolog(stdout: str, base: dict) -> dict:
    """What slurmstepd does with a TaskProlog's stdout: each ``export NAME=value`` line sets NAME (slurm.conf(5))."""
    env = dict(base)
    for line in stdout.splitlines():
        assert line.startswith("export "), line
        name, value = line[len("export "):].split("=", 1)
        env[name] = value
    return env


def test_task_prolog_exports_the_bootstrap_and_its_opt_out_exports_nothing(tmp_path, mfuwatch_cmd):
    """slurmstepd sets the text after '=' literally (no shell unquoting): the lines must carry no quotes, also
    for a config path with a space in it."""
    (tmp_path / "site config").mkdir()
    cfg = tmp_path / "site config" / "agent.yaml"
    cfg.write_text("exporter: false\nnvml: false\nprofile_every: 'off'\nalerts: false\n")
    base = _env(MFUWATCH=str(mfuwatch_cmd), MFUWATCH_SITE_CONFIG=str(cfg), SLURM_JOB_ID="42")
    p = subprocess.run(["bash", str(SLURM / "mfuwatch-task-prolog.sh")], env=base, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [f"export PYTHONPATH={bootstrap_dir()}", f"export MFUWATCH_CONFIG={cfg}",
                                     "export MFUWATCH_JOB=slurm-42"]
    task = subprocess.run([sys.executable, "-c", PROBE], env=_task_env_from_prolog(p.stdout, base),
                          capture_output=True, text=True, timeout=60)
    assert task.stdout.split() == ["armed"], task.stderr[-2000:]
    off = subprocess.run(["bash", str(SLURM / "mfuwatch-task-prolog.sh")], env=dict(base, MFUWATCH_DISABLE="1"),
                         capture_output=True, text=True, timeout=60)
    assert off.returncode == 0 and off.stdout == ""
    # no site config: the bootstrap alone (the agent's defaults)
    p = subprocess.run(["bash", str(SLURM / "mfuwatch-task-prolog.sh")],
                       env=dict(base, MFUWATCH_SITE_CONFIG=str(tmp_path / "none.yaml")), capture_output=True,
                       text=True, timeout=60)
    assert p.stdout.splitlines() == [f"export PYTHONPATH={bootstrap_dir()}", "export MFUWATCH_JOB=slurm-42"]
    # a bad site config: nothing of the bootstrap, the task still starts (status 0), the reason on stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("report_every_step: 5\n")
    p = subprocess.run(["bash", str(SLURM / "mfuwatch-task-prolog.sh")], env=dict(base, MFUWATCH_SITE_CONFIG=str(bad)),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == "" and "report_every_step" in p.stderr
    # the task's own PYTHONPATH stays behind the bootstrap
    p = subprocess.run(["bash", str(SLURM / "mfuwatch-task-prolog.sh")], env=dict(base, PYTHONPATH="/opt/my lib"),
                       capture_output=True, text=True, timeout=60)
    assert p.stdout.splitlines()[0] == f"export PYTHONPATH={bootstrap_dir()}{os.pathsep}/opt/my lib"


def test_srun_wrapper_gives_every_task_the_bootstrap_and_disable_keeps_it_out(tmp_path, mfuwatch_cmd):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(mfuwatch_cmd, bin_dir / "mfuwatch")
    _executable(bin_dir / "srun", '#!/bin/sh\nexec "$@"\n')  # one task, run in the srun's environment
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    cmd = [str(SLURM / "srun-mfuwatch"), sys.executable, "-c", PROBE]
    p = subprocess.run(cmd, env=_env(PATH=path), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.split() == ["armed"], p.stderr[-2000:]
    p = subprocess.run(cmd, env=_env(PATH=path, MFUWATCH_DISABLE="1"), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.split() == ["off"], p.stderr[-2000:]


def test_kubernetes_policy_env_arms_the_bootstrap_from_the_init_containers_directory(tmp_path):
    docs = list(yaml.safe_load_all(K8S.read_text()))
    assert [d["kind"] for d in docs] == ["ConfigMap", "ClusterPolicy"]
    rule = docs[1]["spec"]["rules"][0]
    assert rule["exclude"]["any"][0]["resources"]["selector"]["matchLabels"] == {"mfuwatch.io/disable": "true"}
    spec = rule["mutate"]["patchStrategicMerge"]["spec"]
    init = spec["initContainers"][0]
    target = init["volumeMounts"][0]["mountPath"]
    assert f"--target {target} " in init["command"][-1]
    container = spec["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["mfuwatch"] == target
    env = {e["name"]: e.get("value") for e in container["env"]}
    yaml.safe_load(docs[0]["data"]["agent.yaml"])  # the ConfigMap's agent config is YAML
    assert env["MFUWATCH_CONFIG"].startswith(mounts["mfuwatch-config"] + "/")
    # the initContainer's `pip install --target` layout, here: <target>/mfuwatch/{agent,kernels,alerts}
    local = tmp_path / "target"
    (local / "mfuwatch").mkdir(parents=True)
    for part in ("agent", "kernels", "alerts"):
        (local / "mfuwatch" / part).symlink_to(ROOT / part, target_is_directory=True)
    boot = Path(env["PYTHONPATH"].replace(target, str(local), 1))
    assert (boot / "sitecustomize.py").is_file()
    task_env = _env(PYTHONPATH=str(boot), MFUWATCH_PYTHONPATH=env["MFUWATCH_PYTHONPATH"].replace(target, str(local)))
    p = subprocess.run([sys.executable, "-c", PROBE + "; import sys; print(sys.path[-1])"], env=task_env,
                       capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["armed", str(local)], p.stderr[-2000:]
    p = subprocess.run([sys.executable, "-c", PROBE], env=dict(task_env, MFUWATCH_DISABLE="1"), capture_output=True,
                       text=True, timeout=60)
    assert p.stdout.split() == ["off"], p.stderr[-2000:]
