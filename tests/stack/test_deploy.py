"""deploy/: configs validated by the real tools (promtool, amtool, Alertmanager) and checked for
consistency with each other (Compose services and mounts, Kubernetes selectors, the generated
PrometheusRule). promtool and amtool come from Debian `prometheus` / `prometheus-alertmanager`.
"""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

import httpx
import pytest
import tomllib
import yaml

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"

#: the rules in the shipped file, counted from it (promtool reports the same number)
RULE_COUNT = sum(
    len(g["rules"])
    for g in yaml.safe_load((ROOT / "alerts" / "timwatch.rules.yml").read_text())["groups"]
)


def _tool(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise AssertionError(f"none of {names} found: install Debian prometheus / alertmanager")


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120)


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


# ---- Prometheus ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["prometheus.yml", "remote-write.example.yml"])
def test_promtool_check_config(name: str) -> None:
    proc = _run(_tool("promtool"), "check", "config", DEPLOY / name)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # the rule file is found through the relative path and checked too
    assert (
        f"{RULE_COUNT} rules found" in out and "FAILED" not in out and "WARNING" not in out.upper()
    ), out


def test_prometheus_targets_are_compose_services() -> None:
    prom = _yaml(DEPLOY / "prometheus.yml")
    services = _yaml(DEPLOY / "docker-compose.yml")["services"]
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "timwatch")
    assert job["static_configs"][0]["targets"] == ["timwatch:8000"]
    am = prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert am == ["alertmanager:9093"]
    assert {"timwatch", "alertmanager"} <= set(services)
    assert "8000:8000" in services["timwatch"]["ports"]
    assert "9093:9093" in services["alertmanager"]["ports"]


def test_scrape_interval_matches_grafana_time_interval() -> None:
    prom = _yaml(DEPLOY / "prometheus.yml")
    ds = _yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    assert ds["datasources"][0]["jsonData"]["timeInterval"] == prom["global"]["scrape_interval"]
    monitor = _yaml(K8S / "servicemonitor.yaml")
    assert monitor["spec"]["endpoints"][0]["interval"] == prom["global"]["scrape_interval"]


def test_remote_write_ships_timwatch_series() -> None:
    cfg = _yaml(DEPLOY / "remote-write.example.yml")
    names = {rw["name"] for rw in cfg["remote_write"]}
    assert names == {"thanos", "mimir"}
    for rw in cfg["remote_write"]:
        keep = rw["write_relabel_configs"][0]
        assert keep["action"] == "keep" and keep["source_labels"] == ["__name__"]
    assert cfg["global"]["external_labels"]["replica"]


# ---- Alertmanager --------------------------------------------------------------------------


def test_amtool_check_config() -> None:
    proc = _run(_tool("amtool"), "check-config", DEPLOY / "alertmanager.yml")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "SUCCESS" in out, out
    assert "1 inhibit rules" in out and "2 receivers" in out, out


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["severity=page", "run=a", "alertname=TimwatchMismatchKLRising"], "pager"),
        (["severity=warning", "run=a", "alertname=TimwatchMismatchKLHigh"], "chat"),
        (["alertname=Other"], "chat"),
    ],
)
def test_amtool_routes(labels: list[str], receiver: str) -> None:
    proc = _run(
        _tool("amtool"),
        "config",
        "routes",
        "test",
        f"--config.file={DEPLOY / 'alertmanager.yml'}",
        *labels,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [receiver], proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Hook(http.server.BaseHTTPRequestHandler):
    received: list[tuple[str, dict[str, Any]]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server API)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, json.loads(body)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[tuple[str, dict[str, Any]]]]]:
    received: list[tuple[str, dict[str, Any]]] = []
    handler = type("Hook", (_Hook,), {"received": received})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()
    server.server_close()


def _derived_alertmanager_config(webhook_url: str) -> dict[str, Any]:
    """deploy/alertmanager.yml with the placeholder webhooks pointed at the test's server and the
    group timers shortened; routes, grouping and inhibition are kept as they are."""
    cfg = _yaml(DEPLOY / "alertmanager.yml")
    for receiver in cfg["receivers"]:
        for hook in receiver["webhook_configs"]:
            hook["url"] = f"{webhook_url}/{receiver['name']}"
    for route in [cfg["route"], *cfg["route"]["routes"]]:
        route["group_wait"] = "1s"
        route["group_interval"] = "1s"
    return cfg


def _wait(predicate: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_alertmanager_routes_pages_and_inhibits_a_runs_warnings(
    tmp_path: Path, webhook: tuple[str, list[tuple[str, dict[str, Any]]]]
) -> None:
    url, received = webhook
    config = tmp_path / "alertmanager.yml"
    config.write_text(yaml.safe_dump(_derived_alertmanager_config(url)))
    port = _free_port()
    proc = subprocess.Popen(
        [
            _tool("prometheus-alertmanager", "alertmanager"),
            f"--config.file={config}",
            f"--storage.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}/api/v2"
    try:

        def ready() -> bool:
            try:
                return httpx.get(f"{base}/status", timeout=1).status_code == 200
            except httpx.TransportError:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                return False

        _wait(ready)

        def alert(name: str, severity: str, run: str) -> dict[str, Any]:
            return {"labels": {"alertname": name, "severity": severity, "run": run}}

        posted = [
            alert("TimwatchMismatchKLRising", "page", "drift"),
            alert("TimwatchMismatchKLHigh", "warning", "drift"),
            alert("TimwatchMaskRatioHigh", "warning", "drift"),
            alert("TimwatchMismatchKLHigh", "warning", "healthy-ish"),
        ]
        assert httpx.post(f"{base}/alerts", json=posted, timeout=5).status_code == 200

        def states() -> dict[tuple[str, str], dict[str, Any]] | None:
            got = httpx.get(f"{base}/alerts", timeout=5).json()
            by_key = {(a["labels"]["alertname"], a["labels"]["run"]): a["status"] for a in got}
            return by_key if len(by_key) == 4 else None

        def settled() -> dict[tuple[str, str], dict[str, Any]] | None:
            s = states()
            ok = s and s[("TimwatchMismatchKLHigh", "drift")]["inhibitedBy"]
            return s if ok else None

        status = _wait(settled)
        assert status[("TimwatchMismatchKLRising", "drift")]["state"] == "active"
        for name in ("TimwatchMismatchKLHigh", "TimwatchMaskRatioHigh"):
            assert status[(name, "drift")]["state"] == "suppressed"
            assert status[(name, "drift")]["inhibitedBy"]
        assert status[("TimwatchMismatchKLHigh", "healthy-ish")]["state"] == "active"

        def delivered() -> list[tuple[str, dict[str, Any]]] | None:
            paths = {p for p, _ in received}
            return list(received) if {"/pager", "/chat"} <= paths else None

        notes = _wait(delivered)
        pages = [body for path, body in notes if path == "/pager"]
        chats = [body for path, body in notes if path == "/chat"]
        assert pages[0]["groupLabels"] == {"alertname": "TimwatchMismatchKLRising", "run": "drift"}
        assert pages[0]["alerts"][0]["labels"]["severity"] == "page"
        chat_runs = {a["labels"]["run"] for body in chats for a in body["alerts"]}
        assert chat_runs == {"healthy-ish"}, "a warning of a paging run was not inhibited"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---- Docker --------------------------------------------------------------------------------


def test_dockerfile_installs_the_service_without_torch() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert 'pip install ".[postgres,report]"' in text
    instructions = [
        ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]
    assert not [ln for ln in instructions if "torch" in ln.lower()], "the image must not get torch"
    assert 'exec timwatch serve --host 0.0.0.0 --port 8000 --db \\"$TIMWATCH_DB\\"' in text
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    installed = project["dependencies"] + extras["postgres"] + extras["server"] + extras["report"]
    assert not [d for d in installed if d.lower().startswith("torch")], installed
    copied = {src for ln in instructions if ln.startswith("COPY ") for src in ln.split()[1:-1]}
    # the installed package (timwatch/ and the folders it links in) and nothing else of the repo
    linked = {p.name for p in (ROOT / "timwatch").iterdir() if p.is_symlink()}
    assert linked == {"monitor", "sidecar", "dashboards"}
    assert copied == {"pyproject.toml", "README.md", "timwatch"} | linked
    assert all((ROOT / src).exists() for src in copied)
    # the build context ignore file lets exactly these through
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert {ln[1:].removesuffix("/**") for ln in ignore if ln.startswith("!")} == copied


def _compose() -> dict[str, Any]:
    return _yaml(DEPLOY / "docker-compose.yml")


def test_compose_has_the_stack() -> None:
    services = _compose()["services"]
    assert set(services) == {"timwatch", "prometheus", "alertmanager", "grafana", "postgres"}
    tw = services["timwatch"]
    assert tw["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
    assert (DEPLOY / tw["build"]["context"] / tw["build"]["dockerfile"]).is_file()
    assert tw["environment"]["TIMWATCH_DB"].startswith("postgresql+psycopg://")
    assert "@postgres:5432/" in tw["environment"]["TIMWATCH_DB"]
    assert tw["environment"]["TIMWATCH_TOKEN"].startswith("${TIMWATCH_TOKEN:?")
    assert tw["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_compose_file_validates_with_the_compose_client() -> None:
    """The Compose client's own schema check, offline (Debian's docker-compose, or the plugin)."""
    exe = shutil.which("docker-compose")
    cmd: list[str | Path] = [exe] if exe else [_tool("docker"), "compose"]
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "TIMWATCH_TOKEN": "t", "HOME": str(DEPLOY)}
    proc = subprocess.run(
        [str(c) for c in (*cmd, "-f", DEPLOY / "docker-compose.yml", "config")],
        capture_output=True, text=True, timeout=120, env=env, cwd=DEPLOY,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    rendered = yaml.safe_load(proc.stdout)
    assert set(rendered["services"]) == set(_compose()["services"])
    missing = subprocess.run(
        [str(c) for c in (*cmd, "-f", DEPLOY / "docker-compose.yml", "config")],
        capture_output=True, text=True, timeout=120, cwd=DEPLOY,
        env={k: v for k, v in env.items() if k != "TIMWATCH_TOKEN"},
    )  # fmt: skip
    assert missing.returncode != 0  # the write token is required, not defaulted


def _mounts(service: dict[str, Any]) -> dict[PurePosixPath, Path]:
    """Container path -> host path of a service's bind mounts (named volumes left out)."""
    out = {}
    for spec in service.get("volumes", []):
        src, dst = spec.split(":")[:2]
        if src.startswith((".", "/")):
            out[PurePosixPath(dst)] = (DEPLOY / src).resolve()
    return out


def _host_path(mounts: dict[PurePosixPath, Path], container_path: PurePosixPath) -> Path:
    for dst, src in mounts.items():
        if container_path == dst or dst in container_path.parents:
            return src / container_path.relative_to(dst)
    raise AssertionError(f"{container_path} is not mounted")


def test_compose_bind_mounts_exist_and_prometheus_finds_its_rules() -> None:
    services = _compose()["services"]
    for name, service in services.items():
        for src in _mounts(service).values():
            assert src.exists(), f"{name}: {src} missing"
    prom = services["prometheus"]
    mounts = _mounts(prom)
    flag = next(a for a in prom["command"] if a.startswith("--config.file="))
    config_in_container = PurePosixPath(flag.split("=", 1)[1])
    assert _host_path(mounts, config_in_container) == (DEPLOY / "prometheus.yml").resolve()
    for rule_file in _yaml(DEPLOY / "prometheus.yml")["rule_files"]:
        # resolve the relative path the way Prometheus does: against the config file's directory
        parts: list[str] = []
        for part in (config_in_container.parent / rule_file).parts:
            if part == "..":
                parts.pop()
            else:
                parts.append(part)
        in_container = PurePosixPath(*parts)
        assert (
            _host_path(mounts, in_container) == (ROOT / "alerts" / "timwatch.rules.yml").resolve()
        )
    am = services["alertmanager"]
    flag = next(a for a in am["command"] if a.startswith("--config.file="))
    host = _host_path(_mounts(am), PurePosixPath(flag.split("=", 1)[1]))
    assert host == (DEPLOY / "alertmanager.yml").resolve()


def test_compose_grafana_provisioning_matches_deploy_grafana() -> None:
    grafana = _compose()["services"]["grafana"]
    mounts = _mounts(grafana)
    assert (
        mounts[PurePosixPath("/etc/grafana/provisioning")]
        == (DEPLOY / "grafana" / "provisioning").resolve()
    )
    provider = _yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "timwatch.yml")
    dash_dir = _host_path(mounts, PurePosixPath(provider["providers"][0]["options"]["path"]))
    assert dash_dir == (ROOT / "dashboards").resolve()
    ds = _yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    assert "9090:9090" in _compose()["services"]["prometheus"]["ports"]


# ---- Kubernetes ----------------------------------------------------------------------------


def _load_generator() -> ModuleType:
    path = K8S / "make_prometheusrule.py"
    return load_script(path, "timwatch_make_prometheusrule")


def test_prometheusrule_is_in_sync_with_alerts() -> None:
    gen = _load_generator()
    assert (K8S / "prometheusrule.yaml").read_text() == gen.render(), (
        "deploy/k8s/prometheusrule.yaml is stale: run python deploy/k8s/make_prometheusrule.py"
    )
    manifest = _yaml(K8S / "prometheusrule.yaml")
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["spec"]["groups"] == _yaml(ROOT / "alerts" / "timwatch.rules.yml")["groups"]
    check = _run(sys.executable, K8S / "make_prometheusrule.py", "--check")
    assert check.returncode == 0, check.stderr


def test_prometheusrule_check_flags_a_stale_manifest(tmp_path: Path) -> None:
    stale = tmp_path / "prometheusrule.yaml"
    stale.write_text((K8S / "prometheusrule.yaml").read_text().replace("> 0.02", "> 0.03", 1))
    check = _run(sys.executable, K8S / "make_prometheusrule.py", "--check", "--out", stale)
    assert check.returncode == 1 and "out of date" in check.stderr


def test_prometheusrule_spec_passes_promtool(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(
        yaml.safe_dump({"groups": _yaml(K8S / "prometheusrule.yaml")["spec"]["groups"]})
    )
    proc = _run(_tool("promtool"), "check", "rules", rules)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _kustomized() -> dict[str, dict[str, Any]]:
    kustomization = _yaml(K8S / "kustomization.yaml")
    objects = {}
    for name in kustomization["resources"]:
        obj = _yaml(K8S / name)
        objects[obj["kind"]] = obj
    return objects


def test_k8s_manifests_fit_together() -> None:
    objs = _kustomized()
    assert set(objs) == {"Secret", "Deployment", "Service", "ServiceMonitor", "PrometheusRule"}
    deploy, service, monitor, secret = (
        objs["Deployment"], objs["Service"], objs["ServiceMonitor"], objs["Secret"]
    )  # fmt: skip
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # the Service selects the trainer pods and exposes the sidecar's named port
    assert service["spec"]["selector"].items() <= pod_labels.items()
    containers = {c["name"]: c for c in deploy["spec"]["template"]["spec"]["containers"]}
    sidecar = containers["timwatch"]
    port_names = {p["name"] for p in sidecar["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    # the ServiceMonitor selects that Service and scrapes that port
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {
        p["name"] for p in service["spec"]["ports"]
    }
    # the sidecar runs the service on all interfaces, with a token and the shared database
    assert sidecar["command"] == ["timwatch"]
    assert sidecar["args"][:3] == ["serve", "--host", "0.0.0.0"]
    assert "$(TIMWATCH_DB)" in sidecar["args"]
    env = {e["name"]: e for e in sidecar["env"]}
    assert {"TIMWATCH_TOKEN", "TIMWATCH_DB"} <= set(env)
    for container in containers.values():
        for e in container.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == secret["metadata"]["name"]
                assert ref["key"] in secret["stringData"], ref
    # the trainer reaches its sidecar over localhost on the sidecar's port
    trainer_env = {e["name"]: e.get("value") for e in containers["trainer"]["env"]}
    assert trainer_env["TIMWATCH_URL"] == f"http://127.0.0.1:{sidecar['ports'][0]['containerPort']}"
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/healthz"
