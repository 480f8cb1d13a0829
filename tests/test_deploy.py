"""The deployment files agree with each other and with the service: ports, paths, environment variable
names, the health route, the datasource and the dashboard; and a real Prometheus, scraping a real
server with the repository's scrape config, answers every query of the dashboard with data."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from PIL import Image

from conftest import encode_bytes
from servers import free_port, serve
from service.settings import Settings, default_http_workers

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PROM = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
DATASOURCES = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
DASH_PROVIDERS = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/dashboards.yml").read_text())
DASHBOARD_FILE = ROOT / "deploy/grafana/dashboards/qwen3vl-encoder.json"
DASHBOARD = json.loads(DASHBOARD_FILE.read_text())
K8S = ROOT / "deploy/kubernetes"
K8S_DOCS = {(d["kind"], d["metadata"]["name"]): d for f in sorted(K8S.glob("*.yaml")) if f.name != "kustomization.yaml"
            for d in yaml.safe_load_all(f.read_text()) if d}
KUBERNETES_VERSION = "1.31.0"  # the oldest release whose schema knows the preStop sleep action (1.30+)


def _default(value: str) -> str:
    """`${VAR:-default}` -> default; plain values unchanged."""
    m = re.fullmatch(r"\$\{\w+:-(.*)\}", str(value))
    return m.group(1) if m else str(value)


def _volumes(service: str) -> dict[str, str]:
    """container path -> host path"""
    out = {}
    for v in COMPOSE["services"][service].get("volumes", []):
        v = re.sub(r":(ro|rw)$", "", v.split("#")[0].strip())
        host, container = v.rsplit(":", 1)  # the host side may be ${VAR:-default}
        out[container] = _default(host)
    return out


def test_ports_agree():
    port = Settings().port
    assert f"EXPOSE {port}" in DOCKERFILE and f"QWEN3VL_PORT={port}" in DOCKERFILE
    assert f"{port}:{port}" in COMPOSE["services"]["encoder"]["ports"]
    (target,) = PROM["scrape_configs"][0]["static_configs"][0]["targets"]
    assert target == f"encoder:{port}" and "encoder" in COMPOSE["services"]
    assert PROM["scrape_configs"][0]["metrics_path"] == "/metrics"
    prom_port = DATASOURCES["datasources"][0]["url"].rsplit(":", 1)[1]
    assert f"{prom_port}:{prom_port}" in COMPOSE["services"]["prometheus"]["ports"]


def test_environment_names_are_settings():
    fields = {f"QWEN3VL_{name.upper()}" for name in Settings.model_fields}
    env = COMPOSE["services"]["encoder"]["environment"]
    assert set(env) <= fields, set(env) - fields
    docker_env = set(re.findall(r"(QWEN3VL_\w+)=", DOCKERFILE))
    assert docker_env <= fields, docker_env - fields
    assert Settings(**{k.removeprefix("QWEN3VL_").lower(): _default(v) for k, v in env.items() if _default(v)})


def test_cache_volume_matches_cache_setting():
    """The kernels' cache (compiled kernels, tuning choices) lives on a named volume at QWEN3VL_CACHE_DIR, writable
    by the image's user."""
    (cache,) = re.findall(r"QWEN3VL_CACHE_DIR=(\S+)", DOCKERFILE)
    assert _volumes("encoder")[cache] == "encoder-cache" and "encoder-cache" in COMPOSE["volumes"]
    assert f"VOLUME {cache}" in DOCKERFILE and f"chown encoder {cache}" in DOCKERFILE


def test_model_volume_matches_model_setting():
    model = _default(COMPOSE["services"]["encoder"]["environment"]["QWEN3VL_MODEL"])
    assert model in _volumes("encoder")
    assert f"QWEN3VL_MODEL={model}" in DOCKERFILE and "VOLUME /models" in DOCKERFILE
    assert model.startswith("/models/")


def test_gpu_reservation_and_grace_period():
    devices = COMPOSE["services"]["encoder"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    grace = int(COMPOSE["services"]["encoder"]["stop_grace_period"].rstrip("s"))
    env = COMPOSE["services"]["encoder"]["environment"]
    shutdown = _default(env["QWEN3VL_GRACEFUL_SHUTDOWN_S"]) if "QWEN3VL_GRACEFUL_SHUTDOWN_S" in env else None
    drain = _default(env["QWEN3VL_DRAIN_S"]) if "QWEN3VL_DRAIN_S" in env else None
    # SIGTERM, the drain, then requests in flight finish, before compose's SIGKILL
    assert grace > float(drain or Settings().drain_s) + float(shutdown or Settings().graceful_shutdown_s)


def test_healthcheck_uses_the_health_route():
    from service.http.app import create_app

    health = re.search(r"HEALTHCHECK.*?CMD (.*)", DOCKERFILE, re.S).group(1)
    assert f"127.0.0.1:{Settings().port}/health" in health
    routes = set(create_app(Settings(model="random:tiny")).openapi()["paths"])
    assert {"/health", "/ready", "/metrics", "/embed", "/v1/embeddings", "/info"} <= routes


def test_install_step_is_the_one_ci_runs():
    (step,) = re.findall(r"^RUN (pip install .*)$", DOCKERFILE, re.M)
    assert step in (ROOT / ".ci/run").read_text()
    assert step in (ROOT / "README.md").read_text()


def test_grafana_provisioning():
    (ds,) = DATASOURCES["datasources"]
    assert ds["url"] == "http://prometheus:9090" and "prometheus" in COMPOSE["services"]
    uids = {p["datasource"]["uid"] for p in DASHBOARD["panels"]} | {
        t["datasource"]["uid"] for p in DASHBOARD["panels"] for t in p["targets"]}
    assert uids == {ds["uid"]}
    grafana = _volumes("grafana")
    (provider,) = DASH_PROVIDERS["providers"]
    dash_dir = provider["options"]["path"]
    assert (ROOT / grafana[dash_dir] / DASHBOARD_FILE.name).is_file()
    assert (ROOT / grafana["/etc/grafana/provisioning"] / "datasources/prometheus.yml").is_file()
    home = COMPOSE["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dash_dir}/{DASHBOARD_FILE.name}"
    assert _volumes("prometheus")["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus/prometheus.yml"


def test_dashboard_is_generated_from_make_dashboard():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_dashboard", ROOT / "deploy/make_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.build() == DASHBOARD, "run: python deploy/make_dashboard.py"


# --- Kubernetes --------------------------------------------------------------------------------

def test_kubernetes_manifests_validate_against_the_schemas():
    """Every built-in resource against the Kubernetes OpenAPI schemas (offline, strict: unknown fields fail);
    the two custom resources (PodMonitor, ScaledObject) have their wiring checked below."""
    import kubernetes_validate

    custom = {"PodMonitor", "ScaledObject"}
    checked = 0
    for (kind, name), doc in K8S_DOCS.items():
        if kind not in custom:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            checked += 1
    assert checked >= 5 and custom <= {kind for kind, _ in K8S_DOCS}
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {f.name for f in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def _bytes(size: str) -> int:
    """'1gb', '1Gi', '512m' -> bytes (compose's and Kubernetes' binary units)."""
    number, unit = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", size).groups()
    return int(number) << {"": 0, "k": 10, "m": 20, "g": 30}[unit.lower()[:1]]


def test_shared_memory_room_for_every_front_end():
    """Decoded frames reach the engine through /dev/shm (`shared_memory_mib` per front-end and engine), and the
    embedding cache lives there: compose and the pod give it room for the most front-ends a GPU host gets by default
    (48, on an 8-GPU node of 128 cores) and the cache, beyond Docker's and Kubernetes' 64 MiB default."""
    settings = Settings()
    most = default_http_workers(8, 128)
    need = (most + 1) * (settings.shared_memory_mib << 20) + (settings.embedding_cache_mib << 20) * 9 // 8
    assert _bytes(COMPOSE["services"]["encoder"]["shm_size"]) >= need
    pod = K8S_DOCS[("Deployment", "qwen3vl-encoder")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    name = next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in pod["volumes"] if v["name"] == name)
    assert volume["emptyDir"]["medium"] == "Memory" and _bytes(volume["emptyDir"]["sizeLimit"]) >= need


def test_kubernetes_wiring():
    from service.http.app import create_app

    dep = K8S_DOCS[("Deployment", "qwen3vl-encoder")]
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == Settings().port and dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    routes = set(create_app(Settings(model="random:tiny", device="cpu")).openapi()["paths"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == container["startupProbe"]["httpGet"]["path"] == "/health"
    assert {"/ready", "/health"} <= routes
    env = {e["name"]: e["value"] for e in container["env"]}
    assert {k.removeprefix("QWEN3VL_").lower() for k in env} <= set(Settings.model_fields)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[env["QWEN3VL_CACHE_DIR"]] == "cache" and mounts[env["QWEN3VL_MODEL"]] == "model"
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {name for kind, name in K8S_DOCS if kind == "PersistentVolumeClaim"}
    # it all fits in the grace period: preStop, the server's drain, then its graceful shutdown
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > (pre_stop + float(env["QWEN3VL_DRAIN_S"])
                                                          + float(env["QWEN3VL_GRACEFUL_SHUTDOWN_S"]))
    svc = K8S_DOCS[("Service", "qwen3vl-encoder")]
    assert svc["spec"]["selector"].items() <= labels.items() and svc["spec"]["ports"][0]["targetPort"] in ports
    pdb = K8S_DOCS[("PodDisruptionBudget", "qwen3vl-encoder")]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    monitor = K8S_DOCS[("PodMonitor", "qwen3vl-encoder")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports.keys()
    assert {e["path"] for e in monitor["spec"]["podMetricsEndpoints"]} <= routes
    scaled = K8S_DOCS[("ScaledObject", "qwen3vl-encoder")]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["spec"]["scaleTargetRef"]["name"] == "qwen3vl-encoder"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0


def _autoscaler_exprs():
    return [t["metadata"]["query"] for (kind, _), d in K8S_DOCS.items() if kind == "ScaledObject"
            for t in d["spec"]["triggers"]]


# --- a real Prometheus against a real server ------------------------------------------------------

def _exprs():
    """The dashboard's queries and the autoscaler's."""
    return [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]] + _autoscaler_exprs()


def _metric_names(expr: str) -> set[str]:
    return {m for m in re.findall(r"\b(qwen3vl_[a-z_]+)", expr)}


@pytest.fixture(scope="module")
def prometheus_binary():
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("REQUIRE_PROMETHEUS") == "1":
            pytest.fail("prometheus is not installed (apt-get install -y prometheus)")
        pytest.skip("prometheus is not installed (apt-get install -y prometheus)")
    return binary


def test_every_dashboard_query_returns_data(prometheus_binary, tmp_path):
    with serve(max_wait_ms=5, max_image_pixels=2_000_000) as (url, _):
        host = url.removeprefix("http://")
        config = json.loads(json.dumps(PROM))
        config["global"]["scrape_interval"] = "1s"
        config["scrape_configs"][0]["static_configs"][0]["targets"] = [host]
        # the label the Prometheus operator puts on a pod's series, which the autoscaler's query selects on
        config["scrape_configs"][0]["static_configs"][0]["labels"] = {"namespace": "qwen3vl"}
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom_port = free_port()
        prom = subprocess.Popen([prometheus_binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        api = f"http://127.0.0.1:{prom_port}/api/v1"
        try:
            good = encode_bytes(Image.new("RGB", (96, 64), (1, 2, 3)))
            deadline = time.time() + 40
            exprs = [e.replace("$__rate_interval", "30s") for e in _exprs()]
            missing = exprs
            while missing and time.time() < deadline:
                for _ in range(3):  # traffic: successes and an error, through both endpoints
                    httpx.post(f"{url}/embed", files=[("file", ("a.png", good, "image/png"))] * 2, timeout=30)
                    httpx.post(f"{url}/embed", content=b"junk", headers={"content-type": "image/png"}, timeout=30)
                    httpx.get(f"{url}/health")
                time.sleep(1)
                try:
                    missing = [e for e in exprs if not _has_data(api, e)]
                except httpx.TransportError:
                    continue
            assert not missing, f"queries without data: {missing}"
            names = set(httpx.get(f"{api}/label/__name__/values").json()["data"])
            used = set().union(*(_metric_names(e) for e in _exprs()))
            assert used and used <= names, used - names
        finally:
            prom.terminate()
            prom.wait(30)


def _has_data(api: str, expr: str) -> bool:
    r = httpx.get(f"{api}/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", (expr, r)
    return bool(r["data"]["result"])


def test_the_whole_node_overlay_patches_the_deployment_into_a_valid_one():
    """`deploy/kubernetes/whole-node`: the base's resources with a strategic-merge patch of the Deployment's one
    container, every GPU of an 8-GPU node and the CPUs its front-ends and engines use (`default_http_workers`); the
    patched Deployment validates against the schemas."""
    import copy

    import kubernetes_validate

    overlay = K8S / "whole-node"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert kustomization["resources"] == [".."]
    (patch_ref,) = kustomization["patches"]
    patch = yaml.safe_load((overlay / patch_ref["path"]).read_text())
    base = K8S_DOCS[("Deployment", "qwen3vl-encoder")]
    assert (patch["kind"], patch["metadata"]["name"]) == (base["kind"], base["metadata"]["name"])
    merged = copy.deepcopy(base)
    (container,) = merged["spec"]["template"]["spec"]["containers"]
    (patched,) = patch["spec"]["template"]["spec"]["containers"]
    assert patched["name"] == container["name"]  # the strategic merge's key for containers
    assert set(patched) == {"name", "resources"}
    for part in ("limits", "requests"):
        container["resources"][part].update(patched["resources"][part])
    kubernetes_validate.validate(merged, KUBERNETES_VERSION, strict=True)
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == container["resources"]["requests"]["nvidia.com/gpu"] == 8
    cpus = int(container["resources"]["requests"]["cpu"])
    assert "cpu" not in container["resources"]["limits"]  # the default front-end count reads the node's cores
    assert cpus >= default_http_workers(gpus, 2 * cpus) + gpus  # a core for each front-end and engine
