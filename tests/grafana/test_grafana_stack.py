"""The local stack's files: grafana/compose.yaml, the Prometheus config, Grafana provisioning.

They parse, every file they mount or name exists, images are pinned, ports are published on
127.0.0.1 only, the names that tie the services together agree, and the real ``promtool``
accepts the Prometheus configuration with the committed alerting rules loaded.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from tests.helpers.debian_tools import ensure_binary
from tests.helpers.grafana_dashboards import DASHBOARD_DIR, REPO

GRAFANA = REPO / "grafana"
COMPOSE = yaml.safe_load((GRAFANA / "compose.yaml").read_text(encoding="utf-8"))
SERVICES = COMPOSE["services"]
PROM_CONFIG = yaml.safe_load((GRAFANA / "prometheus" / "prometheus.yml").read_text(encoding="utf-8"))
RULES = GRAFANA / "prometheus" / "rules" / "mfuwatch.rules.yml"  # rendered by `mfuwatch alerts render-prometheus`
AGENT_BASE_PORT = 9478  # agent config default: exporter port = 9478 + LOCAL_RANK


def _mounts(service: str) -> dict:
    """{container path: host path (resolved against grafana/)} of a service's bind mounts."""
    out = {}
    for v in SERVICES[service].get("volumes", []):
        src, dst = v.split(":")[:2]
        if src.startswith("."):
            out[dst] = (GRAFANA / src).resolve()
    return out


def _container_file(service: str, container_path: str) -> Path:
    """The host file behind ``container_path`` in ``service`` (through a file or directory mount)."""
    for dst, src in sorted(_mounts(service).items(), key=lambda kv: -len(kv[0])):
        if container_path == dst:
            return src
        if container_path.startswith(dst.rstrip("/") + "/"):
            return src / container_path[len(dst.rstrip("/")) + 1:]
    raise AssertionError(f"{container_path} is not mounted into {service}")


def test_compose_has_the_three_services_with_pinned_images():
    assert set(SERVICES) == {"prometheus", "alertmanager", "grafana"}
    pins = {s: SERVICES[s]["image"] for s in SERVICES}
    assert re.fullmatch(r"prom/prometheus:v3\.\d+\.\d+", pins["prometheus"]), pins
    assert re.fullmatch(r"prom/alertmanager:v0\.\d+\.\d+", pins["alertmanager"]), pins
    assert re.fullmatch(r"grafana/grafana:1[12]\.\d+\.\d+", pins["grafana"]), pins


def test_every_mounted_file_exists():
    for service in SERVICES:
        for dst, src in _mounts(service).items():
            assert src.exists(), f"{service}: {src} (mounted at {dst}) is missing"
    assert RULES.is_file(), "the rendered alerting rules are missing"
    assert (GRAFANA / "alertmanager" / "alertmanager.yml").is_file()
    yaml.safe_load((GRAFANA / "alertmanager" / "alertmanager.yml").read_text(encoding="utf-8"))


def test_ports_are_published_on_localhost_only():
    expected = {"prometheus": 9090, "alertmanager": 9093, "grafana": 3000}
    for service, port in expected.items():
        assert SERVICES[service]["ports"] == [f"127.0.0.1:{port}:{port}"], service


def test_prometheus_scrapes_the_agents_on_the_host_and_loads_the_rules():
    assert "host.docker.internal:host-gateway" in SERVICES["prometheus"]["extra_hosts"]
    cmd = SERVICES["prometheus"]["command"]
    config_path = next(c.split("=", 1)[1] for c in cmd if c.startswith("--config.file="))
    assert _container_file("prometheus", config_path) == GRAFANA / "prometheus" / "prometheus.yml"
    (job,) = PROM_CONFIG["scrape_configs"]
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"host.docker.internal:{AGENT_BASE_PORT + r}" for r in range(8)]
    # The rule glob points into the mounted rules directory and matches the rendered file.
    (pattern,) = PROM_CONFIG["rule_files"]
    rules_dir = _container_file("prometheus", str(Path(pattern).parent))
    assert RULES in set(rules_dir.glob(Path(pattern).name))
    am = PROM_CONFIG["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert am == ["alertmanager:9093"] and "alertmanager" in SERVICES


def test_alertmanager_reads_its_mounted_config():
    cmd = SERVICES["alertmanager"]["command"]
    path = next(c.split("=", 1)[1] for c in cmd if c.startswith("--config.file="))
    assert _container_file("alertmanager", path) == GRAFANA / "alertmanager" / "alertmanager.yml"


def test_grafana_provisioning_points_at_the_services_and_the_dashboards():
    prov = _container_file("grafana", "/etc/grafana/provisioning")
    assert prov == GRAFANA / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "mfuwatch.yml").read_text(encoding="utf-8"))
    by_type = {d["type"]: d for d in ds["datasources"]}
    assert by_type["prometheus"]["url"] == "http://prometheus:9090" and by_type["prometheus"]["isDefault"]
    assert by_type["alertmanager"]["url"] == "http://alertmanager:9093"
    # $__rate_interval follows the datasource's timeInterval: keep it equal to the scrape interval.
    assert by_type["prometheus"]["jsonData"]["timeInterval"] == PROM_CONFIG["global"]["scrape_interval"]
    dash = yaml.safe_load((prov / "dashboards" / "mfuwatch.yml").read_text(encoding="utf-8"))
    (provider,) = dash["providers"]
    assert provider["type"] == "file"
    assert _container_file("grafana", provider["options"]["path"]) == DASHBOARD_DIR
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert _container_file("grafana", home).is_file()


def test_promtool_accepts_the_config_with_the_committed_rules(tmp_path):
    promtool = ensure_binary(("promtool",), "prometheus")
    cfg = dict(PROM_CONFIG, rule_files=[str(RULES)])
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    res = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout + res.stderr and "rules found" in res.stdout + res.stderr


def test_grafana_holds_no_python():
    assert sorted(GRAFANA.rglob("*.py")) == [], "grafana/ holds no Python run-time code"


def test_alertmanager_secret_files_are_mounted_from_outside_the_repository():
    text = (GRAFANA / "alertmanager" / "alertmanager.yml").read_text(encoding="utf-8")
    secret_files = re.findall(r"(?:api_url_file|credentials_file|password_file):\s*(\S+)", text)
    assert secret_files, "alertmanager.yml reads no secret from a file"
    volumes = [v.split(":")[:2] for v in SERVICES["alertmanager"]["volumes"]]
    for f in secret_files:
        src = next((s for s, d in volumes if f.startswith(d.rstrip("/") + "/")), None)
        assert src is not None, f"{f} is not under any mount of the alertmanager service"
        assert src.startswith("${HOME}/"), f"secrets for {f} must come from outside the repository, not {src}"
