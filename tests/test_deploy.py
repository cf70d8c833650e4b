"""Static checks of deploy/: no Docker engine or cluster is needed, every file is still verified."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from riverbed.bus.consumer import Entry, SessionContext
from riverbed.bus.keys import ROLES, Keys
from riverbed.settings import Settings
from riverbed.workers.main import Worker
from riverbed.workers.metrics import METRIC_NAMES, WorkerMetrics

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
ENV_NAME = re.compile(r"\b(?:RIVERBED|OPENAI)_[A-Z0-9_]+\b")


# --- loading -----------------------------------------------------------------------------------


def settings_variables() -> set[str]:
    """Variables Settings reads (from its fields; tests/test_docs.py checks that the
    configuration page explains each)."""
    return {Settings.variable(field) for field in Settings.__struct_fields__}


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def k8s_objects() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in kustomization()["resources"]:
        out.extend(doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc)
    return out


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [o for o in k8s_objects() if o["kind"] == kind]


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def config_map() -> dict[str, str]:
    [cm] = of_kind("ConfigMap")
    return cm["data"]


def role_of(deployment: dict[str, Any]) -> str:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[0] == "worker"
    assert len(args) == 2
    assert args[1] in ROLES
    return args[1]


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


# --- every file is checked -----------------------------------------------------------------------

CHECKED_BY_NAME = {
    "Dockerfile": "test_dockerfile_runs_as_non_root_with_the_cli_entrypoint",
    "compose.yaml": "test_compose_runs_redis_postgres_and_every_role",
    "README.md": "test_readme_describes_every_file",
    "grafana/riverbed.json": "test_dashboard_uses_only_metrics_a_worker_exports",
    "kubernetes/kustomization.yaml": "test_kustomization_lists_every_manifest",
}


def test_every_deploy_file_is_covered() -> None:
    covered = set(CHECKED_BY_NAME) | {f"kubernetes/{name}" for name in kustomization()["resources"]}
    present = {p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*") if p.is_file()}
    assert present - covered == set(), "new deploy files need a check in tests/test_deploy.py"
    assert covered - present == set()


def test_every_file_parses() -> None:
    for path in DEPLOY.rglob("*"):
        if path.suffix in (".yaml", ".yml"):
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
            assert docs, path
            assert all(isinstance(d, dict) for d in docs), path
        elif path.suffix == ".json":
            assert isinstance(json.loads(path.read_text()), dict)
    known = {"FROM", "ARG", "ENV", "RUN", "WORKDIR", "COPY", "USER", "EXPOSE", "HEALTHCHECK", "STOPSIGNAL"}
    known |= {"ENTRYPOINT", "CMD", "LABEL"}
    assert {instruction for instruction, _ in dockerfile()} <= known


# --- settings and images -----------------------------------------------------------------------------


def test_every_variable_named_in_deploy_is_a_setting() -> None:
    variables = settings_variables()
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            unknown = set(ENV_NAME.findall(path.read_text())) - variables
            assert not unknown, f"{path.relative_to(ROOT)} names unknown variables {unknown}"
    for name, service in compose()["services"].items():
        if str(service.get("image", "")).startswith("riverbed"):
            assert set(service.get("environment", {})) <= variables, name
    for obj in of_kind("ConfigMap"):
        assert set(obj["data"]) <= variables
    for obj in of_kind("Secret"):
        assert set(obj.get("stringData", {})) | set(obj.get("data", {})) <= variables
    for deployment in of_kind("Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert {e["name"] for e in container.get("env", [])} <= variables


def test_image_names_agree() -> None:
    expected = f"riverbed:{version()}"
    compose_images = {s["image"] for s in compose()["services"].values() if s["image"].startswith("riverbed")}
    k8s_images = {c["image"] for d in of_kind("Deployment") for c in d["spec"]["template"]["spec"]["containers"]}
    assert compose_images == {expected}
    assert k8s_images == {expected}
    [override] = kustomization()["images"]
    assert override["name"] == "riverbed"
    assert override["newTag"] == version()
    assert f"-t {expected}" in (DEPLOY / "Dockerfile").read_text()


def test_metrics_port_agrees_everywhere() -> None:
    env: dict[str, str] = {}
    for instruction, args in dockerfile():
        if instruction == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(args) if "=" in item)
    port = env["RIVERBED_METRICS_PORT"]
    assert ("EXPOSE", port) in dockerfile()
    assert config_map()["RIVERBED_METRICS_PORT"] == port
    for name in ROLES:
        assert compose()["services"][name]["environment"]["RIVERBED_METRICS_PORT"] == port
    for deployment in of_kind("Deployment"):
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        assert [p["containerPort"] for p in container["ports"]] == [int(port)]
    [service] = of_kind("Service")
    assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]


# --- Dockerfile and compose --------------------------------------------------------------------------


def test_dockerfile_runs_as_non_root_with_the_cli_entrypoint() -> None:
    instructions = dockerfile()
    froms = [args for i, args in instructions if i == "FROM"]
    assert froms[-1] == "python:3.11-slim"
    final_stage = instructions[max(n for n, (i, _) in enumerate(instructions) if i == "FROM") :]
    users = [args for i, args in final_stage if i == "USER"]
    assert users
    assert users[-1] not in ("root", "0")
    # the roles and the HTTP API need their extras (pip install . alone is the client)
    assert any(i == "RUN" and "pip install '.[worker,serve]'" in args for i, args in instructions)
    assert ("ENTRYPOINT", '["riverbed"]') in instructions
    assert ("CMD", '["worker", "all"]') in instructions
    [health] = [args for i, args in instructions if i == "HEALTHCHECK"]
    assert "/healthz" in health


def test_compose_runs_redis_postgres_and_every_role() -> None:
    services = compose()["services"]
    assert services["redis"]["image"].startswith("redis:7")
    assert "--appendonly" in services["redis"]["command"]
    assert services["redis"]["command"][services["redis"]["command"].index("--appendonly") + 1] == "yes"
    assert services["postgres"]["image"] == "pgvector/pgvector:pg16"
    assert any(v.endswith(":/var/lib/postgresql/data") for v in services["postgres"]["volumes"])
    drain = float(services["runtime"]["environment"]["RIVERBED_DRAIN_SECONDS"])
    for role in ROLES:
        service = services[role]
        assert service["command"] == ["worker", role]
        assert service["deploy"]["replicas"] >= 1
        assert "healthcheck" in service
        assert {"RIVERBED_REDIS_URL", "RIVERBED_DATABASE_URL"} <= set(service["environment"])
        assert float(service["environment"]["RIVERBED_DRAIN_SECONDS"]) == drain
        assert float(service["stop_grace_period"].rstrip("s")) > drain
        assert set(service["depends_on"]) == {"redis", "postgres"}
    for name in ("redis", "postgres"):
        assert "healthcheck" in services[name]
    agent = services["agent"]
    assert agent["command"][0] in ("act", "demo")
    if agent["command"][0] == "act":
        assert "kind" in json.loads(agent["command"][2])
    declared = set(compose()["volumes"])
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            assert source.startswith(("/", ".")) or source in declared


def test_readme_describes_every_file() -> None:
    text = (DEPLOY / "README.md").read_text()
    for name in ("Dockerfile", "compose.yaml", "kubernetes/", "grafana/riverbed.json"):
        assert f"`{name}`" in text
    assert "No Docker engine" in text


# --- Kubernetes ---------------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest() -> None:
    listed = set(kustomization()["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


def test_a_deployment_per_role_with_probes_resources_and_config() -> None:
    deployments = of_kind("Deployment")
    assert sorted(role_of(d) for d in deployments) == sorted(ROLES)
    config_names = {o["metadata"]["name"] for o in of_kind("ConfigMap")}
    secret_names = {o["metadata"]["name"] for o in of_kind("Secret")}
    for deployment in deployments:
        pod = deployment["spec"]["template"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        [container] = pod["spec"]["containers"]
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert {"cpu", "memory"} <= set(container["resources"]["requests"])
        assert {"cpu", "memory"} <= set(container["resources"]["limits"])
        sources = container["envFrom"]
        assert {s["configMapRef"]["name"] for s in sources if "configMapRef" in s} <= config_names
        assert {s["secretRef"]["name"] for s in sources if "secretRef" in s} <= secret_names
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        mounts = {m["name"] for m in container.get("volumeMounts", [])}
        assert mounts <= {v["name"] for v in pod["spec"].get("volumes", [])}


def test_the_runtime_may_build_namespace_sandboxes_and_only_it() -> None:
    """bubblewrap needs user namespaces and mounts; the default container profiles forbid them."""
    for deployment in of_kind("Deployment"):
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        context = container.get("securityContext", {})
        unconfined = context.get("seccompProfile", {}).get("type") == "Unconfined"
        assert unconfined == (role_of(deployment) == "runtime")
        if unconfined:
            assert context["appArmorProfile"]["type"] == "Unconfined"
            assert context["capabilities"]["drop"] == ["ALL"]
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    assert set(services["runtime"]["security_opt"]) == {"seccomp=unconfined", "apparmor=unconfined"}
    assert not [name for name, svc in services.items() if name != "runtime" and "security_opt" in svc]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "bubblewrap" in dockerfile


def test_grace_period_is_longer_than_the_drain() -> None:
    for deployment in of_kind("Deployment"):
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        env = {**config_map(), **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e}}
        drain = float(env.get("RIVERBED_DRAIN_SECONDS", Settings().drain_seconds))
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain


def test_a_disruption_budget_per_role() -> None:
    budgets = of_kind("PodDisruptionBudget")
    for deployment in of_kind("Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        matching = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(matching) == 1, role_of(deployment)
    assert len(budgets) == len(ROLES)


def test_metrics_service_selects_the_worker_pods() -> None:
    [service] = of_kind("Service")
    for deployment in of_kind("Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container["ports"]}


def test_each_scaled_object_watches_its_roles_directory() -> None:
    assert config_map()["RIVERBED_PREFIX"] == "rb"
    keys = Keys("rb")
    deployments = {d["metadata"]["name"]: d for d in of_kind("Deployment")}
    scaled = of_kind("ScaledObject")
    assert len(scaled) == len(ROLES)
    targets = set()
    for obj in scaled:
        target = obj["spec"]["scaleTargetRef"]["name"]
        assert target in deployments
        targets.add(target)
        role = role_of(deployments[target])
        assert obj["spec"]["minReplicaCount"] >= 1
        assert obj["spec"]["maxReplicaCount"] >= obj["spec"]["minReplicaCount"]
        kinds = set()
        for trigger in obj["spec"]["triggers"]:
            assert trigger["type"] == "redis-streams"
            meta = trigger["metadata"]
            assert meta["stream"] == keys.directory(role)
            assert meta["consumerGroup"] == role
            kinds |= {"pendingEntriesCount", "lagCount", "streamLength"} & set(meta)
        assert kinds >= {"pendingEntriesCount", "lagCount"}
    assert targets == set(deployments)


# --- Grafana ------------------------------------------------------------------------------------------


class NullHandler:
    def __init__(self, role: str) -> None:
        self.role = role
        self.ignores_own_answers = False

    async def open(self, ctx: SessionContext) -> None:
        return None

    async def close(self, ctx: SessionContext) -> None:
        return None

    async def recover(self, ctx: SessionContext, entries: list[Entry]) -> None:
        return None

    async def handle(self, ctx: SessionContext, entries: list[Entry]) -> None:
        return None


def exported_names() -> set[str]:
    """Family and sample names a worker with every role exposes (built without any I/O)."""
    worker = Worker(
        aioredis.Redis(),
        Settings(),
        list(ROLES),
        name="w",
        handlers={role: NullHandler(role) for role in ROLES},  # type: ignore[misc]
    )
    metrics = WorkerMetrics()
    metrics.bind(worker)
    names: set[str] = set()
    for family in text_string_to_metric_families(metrics.render().decode()):
        names.add(family.name)
        names |= {s.name for s in family.samples}
    return names


def expressions(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)]
        return found + [e for v in node.values() for e in expressions(v)]
    if isinstance(node, list):
        return [e for v in node for e in expressions(v)]
    return []


def test_dashboard_uses_only_metrics_a_worker_exports() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "riverbed.json").read_text())
    used = {m for e in expressions(dashboard) for m in re.findall(r"\briverbed_[a-z_]+", e)}
    exported = exported_names()
    assert used <= exported, f"not exported: {used - exported}"
    assert used <= METRIC_NAMES
    for wanted in (
        "riverbed_lag_events",
        "riverbed_pending_entries",
        "riverbed_oldest_pending_seconds",
        "riverbed_redeliveries_total",
        "riverbed_dead_letters_total",
        "riverbed_owned_sessions",
        "riverbed_handler_seconds_bucket",
        "riverbed_embedding_cache_hit_ratio",
        "riverbed_append_conflicts_total",
    ):
        assert wanted in used
    quantiles = {q for e in expressions(dashboard) for q in re.findall(r"histogram_quantile\((0\.\d+)", e)}
    assert quantiles >= {"0.5", "0.99"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["targets"] for p in dashboard["panels"])


@pytest.mark.parametrize("role", ROLES)
def test_directory_stream_names_follow_the_keys_module(role: str) -> None:
    text = (K8S / f"{role}.yaml").read_text()
    assert f'stream: "{Keys("rb").directory(role)}"' in text


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_the_manifests() -> None:
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    objects = [d for d in yaml.safe_load_all(rendered) if d]
    assert len(objects) == len(k8s_objects())
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"riverbed"}
