"""deploy/scaleout/: the Compose file, HAProxy and Prometheus configs and Kubernetes manifests
of N replicas + PostgreSQL + Prometheus + VictoriaMetrics, validated offline by the real tools
(the Compose client, `haproxy -c`, `promtool check config`) and checked against each other:
every replica is behind the balancer and scraped directly, remote-write reaches VictoriaMetrics,
and the Kubernetes objects select each other. tests/stack/test_scaleout.py runs the same
haproxy.cfg and prometheus.yml on Debian packages.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCALEOUT = ROOT / "deploy" / "scaleout"
K8S = SCALEOUT / "k8s"

#: the rules in the shipped file, counted from it (promtool reports the same number)
RULE_COUNT = sum(
    len(g["rules"])
    for g in yaml.safe_load((ROOT / "alerts" / "timwatch.rules.yml").read_text())["groups"]
)


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def _run(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=120, env=env
    )


def _replicas() -> list[str]:
    services = _yaml(SCALEOUT / "docker-compose.yml")["services"]
    return sorted(n for n in services if re.fullmatch(r"timwatch-\d+", n))


def test_compose_validates_with_the_compose_client() -> None:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("install the Debian package docker-compose (scripts/test.sh does)")
    env = {"PATH": "/usr/bin:/bin", "TIMWATCH_TOKEN": "t"}
    proc = _run(exe, "-f", SCALEOUT / "docker-compose.yml", "config", env=env)
    assert proc.returncode == 0, proc.stderr
    rendered = yaml.safe_load(proc.stdout)["services"]
    assert {"postgres", "haproxy", "prometheus", "victoria-metrics", "alertmanager"} <= set(
        rendered
    )
    assert len(_replicas()) == 3
    for name in _replicas():
        env_vars = rendered[name]["environment"]
        assert (
            env_vars["TIMWATCH_DB"].startswith("postgresql+psycopg://")
            and "@postgres:" in (env_vars["TIMWATCH_DB"])
        )
        assert env_vars["TIMWATCH_REPLICA_ID"] == name  # stable, one per replica
        assert env_vars["TIMWATCH_TOKEN"] == "t"
    # the token is mandatory: without it the client refuses the file
    bare = _run(exe, "-f", SCALEOUT / "docker-compose.yml", "config", env={"PATH": "/usr/bin"})
    assert bare.returncode != 0 and "TIMWATCH_TOKEN" in bare.stderr


def test_compose_bind_mounts_exist() -> None:
    services = _yaml(SCALEOUT / "docker-compose.yml")["services"]
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (SCALEOUT / src).exists(), (name, src)
    prom = services["prometheus"]
    config = next(a for a in prom["command"] if a.startswith("--config.file="))
    mounts = dict(v.split(":")[:2] for v in prom["volumes"] if v.startswith("."))
    inside = config.split("=", 1)[1]
    assert mounts["./prometheus.yml"] == inside
    # the relative rule path resolves inside the container as in the repo
    (rules,) = _yaml(SCALEOUT / "prometheus.yml")["rule_files"]
    resolved = (Path(inside).parent / rules).resolve()
    assert mounts["../../alerts"] == str(resolved.parent)


def test_haproxy_balances_every_replica_round_robin_with_health_checks() -> None:
    exe = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")
    assert exe, "install the Debian package haproxy"
    proc = _run(exe, "-c", "-f", SCALEOUT / "haproxy.cfg")
    assert proc.returncode == 0 and "Configuration file is valid" in proc.stdout + proc.stderr
    text = (SCALEOUT / "haproxy.cfg").read_text()
    servers = re.findall(r"^\s+server (\S+) (\S+)$", text, flags=re.M)
    assert [(n, f"{n}:8000") for n in _replicas()] == servers
    assert "balance roundrobin" in text and "option httpchk GET /healthz" in text
    assert "bind :8000" in text


def test_prometheus_scrapes_each_replica_and_writes_to_victoriametrics() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "install the Debian package prometheus"
    proc = _run(promtool, "check", "config", SCALEOUT / "prometheus.yml")
    out = proc.stdout + proc.stderr
    assert (
        proc.returncode == 0 and f"{RULE_COUNT} rules found" in out and "WARNING" not in out.upper()
    ), out
    doc = _yaml(SCALEOUT / "prometheus.yml")
    (job,) = [j for j in doc["scrape_configs"] if j["job_name"] == "timwatch"]
    assert job["static_configs"][0]["targets"] == [f"{n}:8000" for n in _replicas()]
    (rw,) = doc["remote_write"]
    assert rw["url"] == "http://victoria-metrics:8428/api/v1/write"
    (keep,) = rw["write_relabel_configs"]
    assert keep["action"] == "keep" and re.fullmatch(keep["regex"], "timwatch_tokens_total")
    assert re.fullmatch(keep["regex"], "timwatch:mismatch_kl:rate10m")
    assert "vminsert:8480/insert/" in (SCALEOUT / "prometheus.yml").read_text()


def _k8s() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for name in _yaml(K8S / "kustomization.yaml")["resources"]:
        for doc in _docs(K8S / name):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def test_k8s_manifests_fit_together() -> None:
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(_yaml(K8S / "kustomization.yaml")["resources"]) == files
    objs = _k8s()
    deploy = objs[("StatefulSet", "timwatch")]
    assert deploy["spec"]["replicas"] >= 2
    # stable pod names are the replicas' ids, and the scrape's instance label
    assert deploy["spec"]["serviceName"] == "timwatch-replicas"
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    (rid,) = [e for e in container["env"] if e["name"] == "TIMWATCH_REPLICA_ID"]
    assert rid["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    for svc_name in ("timwatch", "timwatch-replicas"):
        svc = objs[("Service", svc_name)]
        assert svc["spec"]["selector"].items() <= pod_labels.items(), svc_name
    assert objs[("Service", "timwatch-replicas")]["spec"]["clusterIP"] == "None"
    monitor = objs[("ServiceMonitor", "timwatch-replicas")]
    replicas_svc = objs[("Service", "timwatch-replicas")]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        replicas_svc["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["port"] == replicas_svc["spec"]["ports"][0]["name"]
    (relabel,) = monitor["spec"]["endpoints"][0]["relabelings"]
    assert relabel == {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "instance"}
    prom = objs[("Prometheus", "timwatch")]
    assert prom["spec"]["serviceMonitorSelector"]["matchLabels"].items() <= (
        monitor["metadata"]["labels"].items()
    )
    rule = _yaml(ROOT / "deploy" / "k8s" / "prometheusrule.yaml")
    assert prom["spec"]["ruleSelector"]["matchLabels"].items() <= rule["metadata"]["labels"].items()
    vm = objs[("Service", "victoria-metrics")]
    (rw,) = prom["spec"]["remoteWrite"]
    assert (
        rw["url"]
        == f"http://{vm['metadata']['name']}:{vm['spec']['ports'][0]['port']}/api/v1/write"
    )
    # the Secret the pods read has every key they ask for
    secret = objs[("Secret", "timwatch")]["stringData"]
    for pod in (deploy, objs[("StatefulSet", "postgres")]):
        for c in pod["spec"]["template"]["spec"]["containers"]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == "timwatch" and ref["key"] in secret, env
    assert "@postgres:5432/" in secret["db-url"]
    pg = objs[("Service", "postgres")]
    assert pg["spec"]["ports"][0]["port"] == 5432
