"""``mfuwatch run``: the agent injected into an unmodified script, compared with ``watch()`` on the same script.

The script (tests/fixtures/attach/plain_train.py) trains a small language model; run once under
``mfuwatch run`` and once with the one ``watch(model, optimizer)`` line it has behind ``--watch``,
with the same config file (``report_every_steps: 1``: one step record per optimizer step). The
attached agent misses the job's first step (its forward ran before the model was known), so its
records must be exactly those of ``watch()`` from step 2 on: step numbers, step counts, tokens
(batch x sequence by hand), model and hardware FLOPs (FlopCounterMode over the job's 2nd step, in
both runs). The job's own result (losses and final weights) must not change.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from mfuwatch.agent.attach import attach_env, bootstrap_dir
from mfuwatch.agent.live.timeline import read_timeline

SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "attach" / "plain_train.py"
STEPS, BATCH, SEQ = 8, 4, 16
KEYS = ("step", "steps", "tokens", "model_flops", "hardware_flops")


def _config(tmp_path: Path, timeline: Path, report_every_steps: int = 1) -> Path:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"exporter": False, "nvml": False, "profile_every": "off", "alerts": False,
                                   "report_every_steps": report_every_steps, "timeline": str(timeline),
                                   "progress": False}))
    return cfg


def _env(**extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("MFUWATCH_CONFIG", "MFUWATCH_DISABLE", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    env.update(extra)
    return env


def _steps(path: Path) -> list:
    return [{k: r[k] for k in KEYS} for r in read_timeline(path) if r["kind"] == "step"]


def _run_record(path: Path) -> dict:
    return next(r for r in read_timeline(path) if r["kind"] == "run")


def _mfuwatch(*args: str) -> list:
    return [sys.executable, "-m", "mfuwatch.agent.cli", *args]


def test_run_attaches_to_an_unmodified_script_with_the_records_of_watch(tmp_path):
    runs = {}
    for name in ("watch", "attach"):
        tl = tmp_path / f"{name}.jsonl"
        (tmp_path / name).mkdir()
        cfg = _config(tmp_path / name, tl)
        out = tmp_path / f"{name}.json"
        script = [sys.executable, str(SCRIPT), "--steps", str(STEPS), "--batch", str(BATCH), "--seq", str(SEQ),
                  "--out", str(out)]
        if name == "watch":
            cmd, env = script + ["--watch"], _env(MFUWATCH_CONFIG=str(cfg))
        else:
            cmd, env = _mfuwatch("run", "--config", str(cfg), "--", *script), _env()
        p = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = (_steps(tl), _run_record(tl), json.loads(out.read_text()), p.stderr)
    (w_steps, w_run, w_result, _), (a_steps, a_run, a_result, a_err) = runs["watch"], runs["attach"]
    assert [s["step"] for s in w_steps] == list(range(1, STEPS + 1))
    assert [s["step"] for s in a_steps] == list(range(2, STEPS + 1)), a_err[-2000:]
    assert a_steps == w_steps[1:]
    assert all(s["tokens"] == BATCH * SEQ and s["steps"] == 1 for s in a_steps)
    assert a_steps[0]["model_flops"] > 0  # counted over the job's 2nd step in both runs
    assert a_run["flops_source"] == w_run["flops_source"] == "flop_counter"
    assert a_result == w_result  # the job's losses and weights are its own
    assert "attaching failed" not in a_err


def test_reports_of_n_steps_cover_the_job_steps_2_to_n_plus_1(tmp_path):
    """``report_every_steps: 3`` over 8 job steps: reports of steps 2..4, 5..7 and (at exit) 8.

    The job's step 1 ran before the agent existed: it is in no report (counted neither as a step nor in
    the tokens), so each report's ``steps`` and ``tokens`` agree (B x T = 4 x 16 per step, by hand).
    """
    tl = tmp_path / "tl.jsonl"
    cfg = _config(tmp_path, tl, report_every_steps=3)
    script = [sys.executable, str(SCRIPT), "--steps", str(STEPS), "--batch", str(BATCH), "--seq", str(SEQ)]
    p = subprocess.run(_mfuwatch("run", "--config", str(cfg), "--", *script), env=_env(), cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    got = [(s["step"], s["steps"], s["tokens"]) for s in _steps(tl)]
    assert got == [(4, 3, 3 * BATCH * SEQ), (7, 3, 3 * BATCH * SEQ), (8, 1, BATCH * SEQ)], p.stderr[-2000:]


def _torchrun(tmp_path: Path, cfg: Path, extra: list, attach: bool) -> subprocess.CompletedProcess:
    script = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
              str(SCRIPT), "--steps", str(STEPS), "--ddp", *extra]
    if attach:
        cmd, env = _mfuwatch("run", "--config", str(cfg), "--", sys.executable, *script), _env()
    else:
        cmd, env = [sys.executable, *script, "--watch"], _env(MFUWATCH_CONFIG=str(cfg))
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_run_under_torchrun_two_ranks_ddp_matches_watch(tmp_path):
    """torchrun --nproc-per-node 2 (gloo): each rank attaches through DDP, with watch()'s records per rank."""
    steps = {}
    for name in ("watch", "attach"):
        d = tmp_path / name
        d.mkdir()
        cfg = _config(d, d / "tl.rank{rank}.jsonl")  # the config's "{rank}": one timeline per rank
        p = _torchrun(d, cfg, ["--out", str(d / "result.json")], attach=name == "attach")
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        steps[name] = {r: _steps(d / f"tl.rank{r}.jsonl") for r in (0, 1)}
        for r in (0, 1):
            assert _run_record(d / f"tl.rank{r}.jsonl")["world_size"] == 2
    for r in (0, 1):
        assert [s["step"] for s in steps["attach"][r]] == list(range(2, STEPS + 1))
        assert steps["attach"][r] == steps["watch"][r][1:]
        assert all(s["tokens"] == 4 * 16 for s in steps["attach"][r])


def test_exit_code_passes_through_and_disable_keeps_the_environment(tmp_path):
    p = subprocess.run(_mfuwatch("run", "--", "sh", "-c", "exit 7"), env=_env(), capture_output=True, timeout=60)
    assert p.returncode == 7
    code = "import os, sys; print(os.environ.get('PYTHONPATH', '')); print(sys.modules.get('sitecustomize'))"
    p = subprocess.run(_mfuwatch("run", sys.executable, "-c", code), env=_env(), capture_output=True, text=True,
                       timeout=60)
    path, mod = p.stdout.splitlines()
    assert path.split(os.pathsep)[0] == bootstrap_dir() and bootstrap_dir() in mod
    p = subprocess.run(_mfuwatch("run", sys.executable, "-c", code), env=_env(MFUWATCH_DISABLE="1"),
                       capture_output=True, text=True, timeout=60)
    assert bootstrap_dir() not in p.stdout
    p = subprocess.run(_mfuwatch("run", "--", "no-such-command-xyz"), env=_env(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 127 and "command not found" in p.stderr


def test_print_env_gives_the_lines_a_slurm_prolog_exports(tmp_path):
    cfg = _config(tmp_path, tmp_path / "tl.jsonl")
    p = subprocess.run(_mfuwatch("run", "--config", str(cfg), "--print-env"), env=_env(PYTHONPATH="/site/x"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [f"export PYTHONPATH={bootstrap_dir()}{os.pathsep}/site/x",
                                     f"export MFUWATCH_CONFIG={cfg.resolve()}"]


def test_bad_config_fails_before_the_job_starts(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("report_every_step: 5\n")
    marker = tmp_path / "ran"
    p = subprocess.run(_mfuwatch("run", "--config", str(cfg), "--", "touch", str(marker)), env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "did you mean 'report_every_steps'" in p.stderr
    assert not marker.exists()


def test_a_bad_config_in_mfuwatch_config_fails_before_the_job_starts(tmp_path):
    """Without ``--config`` the agent reads ``$MFUWATCH_CONFIG``: ``mfuwatch run`` checks that one instead."""
    (tmp_path / "bad.yaml").write_text("report_every_step: 5\n")
    marker = tmp_path / "ran"
    p = subprocess.run(_mfuwatch("run", "--", "touch", str(marker)), env=_env(MFUWATCH_CONFIG="bad.yaml"),
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "did you mean 'report_every_steps'" in p.stderr
    assert not marker.exists()
    p = subprocess.run(_mfuwatch("run", "--", "touch", str(marker)), env=_env(MFUWATCH_CONFIG="missing.yaml"),
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "MFUWATCH_CONFIG: file not found: missing.yaml" in p.stderr
    assert not marker.exists()
    _config(tmp_path, tmp_path / "tl.jsonl")  # a good one, named relative to the working directory
    code = "import os; print(os.environ['MFUWATCH_CONFIG'])"
    p = subprocess.run(_mfuwatch("run", "--", sys.executable, "-c", code), env=_env(MFUWATCH_CONFIG="agent.yaml"),
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == str((tmp_path / "agent.yaml").resolve()), p.stderr


def test_disable_runs_the_command_as_without_mfuwatch_even_with_a_bad_config(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("report_every_step: 5\n")
    marker = tmp_path / "ran"
    p = subprocess.run(_mfuwatch("run", "--config", str(cfg), "--", "touch", str(marker)),
                       env=_env(MFUWATCH_DISABLE="1"), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert marker.exists()


@pytest.mark.parametrize("args, message", [
    (["--config=", "true"], "--config: expected a file name"),
    (["--config", "{tmp}", "true"], "--config: not a file: {tmp}"),
    (["--print-env", "--", "true"], "--print-env takes no command"),
    (["--"], "no command given"),
])
def test_usage_errors_exit_2_before_anything_runs(tmp_path, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    p = subprocess.run(_mfuwatch("run", *args), env=_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and message.format(tmp=tmp_path) in p.stderr, p.stderr
    assert p.stdout == ""


def test_an_empty_pythonpath_entry_still_means_the_working_directory(tmp_path):
    """``export PYTHONPATH=$PYTHONPATH:/x`` with none set gives ":/x": Python reads the empty entry as the working
    directory, so a script in a subdirectory imports the job's local modules. Under ``mfuwatch run`` too."""
    (tmp_path / "localmod.py").write_text("VALUE = 7\n")
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "train.py"
    script.write_text("import localmod, sys; print(localmod.VALUE)\n")
    env = _env(PYTHONPATH=os.pathsep + str(tmp_path / "nowhere"))
    plain = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
    assert plain.stdout.strip() == "7", plain.stderr  # the premise: plain Python finds it
    p = subprocess.run(_mfuwatch("run", sys.executable, str(script)), env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "7", p.stderr[-2000:]
    assert attach_env({"PYTHONPATH": "/a" + os.pathsep}) == {"PYTHONPATH": os.pathsep.join([bootstrap_dir(), "/a", ""])}
    assert attach_env({"PYTHONPATH": ""}) == attach_env({}) == {"PYTHONPATH": bootstrap_dir()}


def test_the_bootstrap_chains_to_the_sitecustomize_it_shadows(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.OTHER_SITECUSTOMIZE_RAN = True\n")
    env = attach_env(_env(PYTHONPATH=str(other)))
    code = "import builtins, sys; print(getattr(builtins, 'OTHER_SITECUSTOMIZE_RAN', False), 'torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["True", "False"], p.stderr  # chained; and torch is not imported by the bootstrap


def test_mfuwatch_pythonpath_is_appended_after_site_packages_once_torch_is_imported(tmp_path):
    """mfuwatch installed apart (``pip install --target DIR``, the Kubernetes initContainer) with its own copies
    of packages the job has too: ``MFUWATCH_PYTHONPATH=DIR`` makes DIR a fallback, so the job's yaml stays its own."""
    extra = tmp_path / "extra"
    (extra / "yaml").mkdir(parents=True)
    (extra / "yaml" / "__init__.py").write_text("SHADOW = True\n")  # an older copy the job must not get
    (extra / "only_in_extra.py").write_text("")
    env = attach_env(_env(MFUWATCH_PYTHONPATH=str(extra)))
    code = ("import importlib.util, sys; before = importlib.util.find_spec('only_in_extra') is not None; "
            "import torch, yaml, only_in_extra; "
            "print(before, getattr(yaml, 'SHADOW', False), sys.path[-1] == sys.argv[1])")
    p = subprocess.run([sys.executable, "-c", code, str(extra)], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["False", "False", "True"]


def test_the_bootstrap_waits_for_the_real_import_of_torch_not_a_probe():
    """Libraries probe with importlib.util.find_spec("torch") (transformers does) before importing it."""
    code = ("import importlib.util, sys; importlib.util.find_spec('torch'); "
            "print('mfuwatch.agent.attach.attacher' in sys.modules); import torch; "
            "import mfuwatch.agent.attach.attacher as a; print(a._installed is not None and a._installed.state)")
    p = subprocess.run([sys.executable, "-c", code], env=attach_env(_env()), capture_output=True, text=True,
                       timeout=120)
    assert p.stdout.split() == ["False", "armed"], p.stderr[-2000:]


# ------------------------------------------------------------------ in-process: compile, failure, choice
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.lin = nn.Linear(16, 32)

    def forward(self, ids=None, input_ids=None):
        return self.lin(self.emb(ids if ids is not None else input_ids))


def _train(model, opt, steps, kwargs=False):
    torch.manual_seed(3)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 32, (2, 8))
        out = model(input_ids=ids) if kwargs else model(ids)
        loss = out.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


@pytest.fixture
def attacher_factory():
    from mfuwatch.agent.attach.attacher import Attacher

    made = []

    def make(make_agent=None):
        a = Attacher(make_agent)
        a.arm()
        made.append(a)
        return a

    yield make
    for a in made:
        a.disarm()
        if a.agent is not None:
            a.agent.close()


def _agent_kwargs(timeline):
    return dict(exporter=False, nvml=False, profile_every="off", alerts=False, report_every_steps=1, progress=False,
                timeline=str(timeline))


@pytest.mark.parametrize("kwargs", [False, True], ids=["positional", "keyword"])
def test_attach_through_torch_compile_keeps_the_wrapper(attacher_factory, tmp_path, kwargs):
    """Hooks go on the eager OptimizedModule wrapper (hooks added inside a compiled graph would not run); the
    attach forward's tokens come from its positional or (in the global forward hook) keyword inputs."""
    from mfuwatch.agent.core import Agent

    torch.manual_seed(0)
    net = _Net()
    compiled = torch.compile(net, backend="aot_eager")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    a = attacher_factory(lambda m, o: Agent(m, o, **_agent_kwargs(tmp_path / "tl.jsonl")))
    _train(compiled, opt, 5, kwargs=kwargs)
    assert a.state == "attached" and a.model is compiled
    from torch.nn.modules import module as module_mod

    assert not module_mod._has_any_global_hook()  # none of ours left behind (the compiled wrapper warns else)
    a.agent.close()
    steps = _steps(tmp_path / "tl.jsonl")
    assert [s["step"] for s in steps] == [2, 3, 4, 5]
    assert [s["tokens"] for s in steps] == [16] * 4  # 2 sequences x 8 tokens per step, by hand


def test_failing_attach_leaves_the_job_unchanged_with_one_warning(attacher_factory, caplog):
    torch.manual_seed(0)
    ref_net = _Net()
    ref = _train(ref_net, torch.optim.SGD(ref_net.parameters(), lr=0.1), 6)
    torch.manual_seed(0)
    net = _Net()

    def broken(model, optimizer):
        raise RuntimeError("broken on purpose")

    a = attacher_factory(broken)
    with caplog.at_level(logging.WARNING, logger="mfuwatch"):
        got = _train(net, torch.optim.SGD(net.parameters(), lr=0.1), 6)
    assert got == ref
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), ref_net.parameters()))
    assert a.state == "failed"
    warnings = [r for r in caplog.records if "attaching failed" in r.getMessage()]
    assert len(warnings) == 1 and "broken on purpose" in warnings[0].getMessage()
    from torch.nn.modules import module as module_mod

    assert not module_mod._has_any_global_hook()


def test_a_model_compiled_in_place_is_attached_with_the_records_of_the_eager_model(attacher_factory, tmp_path):
    """``module.compile()`` puts the module's hooks inside the compiled graph; the agent's forward hooks go
    around the compiled call instead (agent/live/hooks.py ``_CompiledInPlace``), so the attached job's step,
    token and FLOP records are those of the same job run eagerly, and its losses are its own."""
    from mfuwatch.agent.core import Agent

    torch.manual_seed(0)
    ref_net = _Net()
    a_ref = attacher_factory(lambda m, o: Agent(m, o, **_agent_kwargs(tmp_path / "eager.jsonl")))
    ref = _train(ref_net, torch.optim.SGD(ref_net.parameters(), lr=0.1), 5)
    a_ref.agent.close()
    a_ref.disarm()
    torch.manual_seed(0)
    net = _Net()
    net.compile(backend="aot_eager")
    a = attacher_factory(lambda m, o: Agent(m, o, **_agent_kwargs(tmp_path / "tl.jsonl")))
    got = _train(net, torch.optim.SGD(net.parameters(), lr=0.1), 5)
    assert a.state == "attached" and a.model is net
    a.agent.close()
    assert got == pytest.approx(ref, rel=1e-6)
    steps, eager = _steps(tmp_path / "tl.jsonl"), _steps(tmp_path / "eager.jsonl")
    assert [s["step"] for s in steps] == [2, 3, 4, 5]
    # the first attached step may hold the compile (warm-up); from the next on, every record equals eager's
    assert [{k: v for k, v in s.items() if "second" not in k and k != "mfu"} for s in steps[1:]] == [
        {k: v for k, v in s.items() if "second" not in k and k != "mfu"} for s in eager[1:]]
    from torch.nn.modules import module as module_mod

    assert not module_mod._has_any_global_hook()


def test_attach_picks_the_called_module_of_the_optimizer_not_an_outer_container(attacher_factory, tmp_path):
    """A LightningModule-like container holds the model but is never called: the model is what is called."""
    from mfuwatch.agent.core import Agent

    class Container(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = _Net()
            self.frozen = nn.Linear(4, 4).requires_grad_(False)

    torch.manual_seed(0)
    box = Container()
    opt = torch.optim.SGD([p for p in box.parameters() if p.requires_grad], lr=0.1)
    a = attacher_factory(lambda m, o: Agent(m, o, **_agent_kwargs(tmp_path / "tl.jsonl")))
    for _ in range(4):
        box.frozen(torch.zeros(1, 4))  # holds no optimizer parameter: passed over
        box.model(torch.randint(0, 32, (3, 5))).sum().backward()
        opt.step()
        opt.zero_grad()
    assert a.model is box.model
    agent = a.agent
    agent.close()
    steps = _steps(tmp_path / "tl.jsonl")
    assert [s["step"] for s in steps] == [2, 3, 4] and all(s["tokens"] == 15 for s in steps)


def test_unwrap_data_parallel_wrappers_but_not_compile(tmp_path):
    import torch.distributed as dist

    from mfuwatch.agent.attach.attacher import unwrap

    net = _Net()
    assert unwrap(nn.DataParallel(net)) is net
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert unwrap(nn.parallel.DistributedDataParallel(net)) is net
    finally:
        dist.destroy_process_group()
    compiled = torch.compile(net, backend="eager")
    assert unwrap(compiled) is compiled


def test_attach_through_fsdp2_keeps_the_module_fully_shard_changed_in_place(attacher_factory, tmp_path):
    """fully_shard (FSDP2, gloo, one rank) swaps the module's class and parameters in place: no wrapper to
    unwrap. The FLOPs are FlopCounterMode's over the job's 2nd step: 6 x N x tokens by hand, N the two
    Linear weights (the embedding is a lookup)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from mfuwatch.agent.core import Agent

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.l1 = nn.Linear(16, 16, bias=False)
            self.l2 = nn.Linear(16, 32, bias=False)

        def forward(self, ids):
            return self.l2(self.l1(self.emb(ids)))

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = Net()
        fully_shard(net.l1)
        fully_shard(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        a = attacher_factory(lambda m, o: Agent(m, o, **_agent_kwargs(tmp_path / "tl.jsonl")))
        for _ in range(4):
            net(torch.randint(0, 32, (2, 8))).sum().backward()
            opt.step()
            opt.zero_grad()
        assert a.state == "attached" and a.model is net and type(net).__name__ == "FSDPNet"
        a.agent.close()
    finally:
        dist.destroy_process_group()
    steps = _steps(tmp_path / "tl.jsonl")
    assert [s["step"] for s in steps] == [2, 3, 4] and all(s["tokens"] == 16 for s in steps)
    assert all(s["model_flops"] == 6 * (16 * 16 + 16 * 32) * 16 for s in steps)
