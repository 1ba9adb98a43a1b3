"""The package build as setuptools reads pyproject.toml: every shipped folder a configured package, and the attach
bootstrap's sitecustomize.py in the built tree. (The license stays a TOML table, which setuptools >= 77 calls
deprecated: the SPDX string form fails on older setuptools, as in the GPU image's no-build-isolation install.)"""

from __future__ import annotations

import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_build_py_raises_no_setuptools_warning_and_ships_the_bootstrap(tmp_path, monkeypatch):
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(ROOT)  # package-dir paths are relative to the project root
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
        dist.script_name = "setup.py"
        cmd = dist.get_command_obj("build_py")
        cmd.build_lib = str(tmp_path)
        dist.run_command("build_py")
    messages = [str(w.message) for w in caught if "setuptools" in type(w.message).__module__
                and "project.license" not in str(w.message)]
    assert messages == []  # e.g. "Package 'mfuwatch.agent.attach.boot' is absent from the `packages` configuration"
    assert (tmp_path / "mfuwatch/agent/attach/boot/sitecustomize.py").is_file()
    assert (tmp_path / "mfuwatch/agent/data/gpus.yaml").is_file()
