"""The deployment files as an operator uses them: the container image's entry point and
environment, the compose file and the Kubernetes sidecar manifest.

No container runtime reaches an image registry here, so the image is not built: its
entry point runs from this checkout with exactly the environment and command the
Containerfile declares. The YAML files are parsed and checked for what makes them work
(every referenced volume, secret and config map exists; the tenant file they carry
passes check-config).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import orjson
import yaml
from helpers import cli_env, run_cli

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def _containerfile() -> tuple[dict[str, str], list[str]]:
    """(ENV settings, CMD arguments) of the Containerfile."""
    env: dict[str, str] = {}
    cmd: list[str] = []
    for line in (REPO / "Containerfile").read_text().splitlines():
        if line.startswith("ENV "):
            key, _, value = line[4:].partition("=")
            env[key.strip()] = value.strip()
        elif line.startswith("CMD "):
            cmd = orjson.loads(line[4:])
    return env, cmd


def test_the_container_without_a_dsn_refuses_an_embedded_database(tmp_path: Path) -> None:
    image_env, cmd = _containerfile()
    assert image_env["INBOXD_EMBEDDED_PG"] == "refuse"
    config = tmp_path / "inboxd.toml"
    text = (REPO / cmd[cmd.index("--config") + 1].replace("/opt/inboxd/", "")).read_text()
    parsed = tomllib.loads(text)
    # The image's config, with its container paths moved under tmp_path.
    parsed["object_store"]["path"] = str(tmp_path / "objects")
    parsed["tenants"]["dir"] = str(tmp_path / "tenants")
    parsed["listener"]["port"] = 0
    (tmp_path / "tenants").mkdir()
    config.write_text(
        "\n".join(
            f"[{section}]\n" + "\n".join(f"{k} = {orjson.dumps(v).decode()}" for k, v in t.items())
            for section, t in parsed.items()
        )
    )
    data = tmp_path / "data"
    env = cli_env(data, INBOXD_EMBEDDED_PG=image_env["INBOXD_EMBEDDED_PG"])
    result = run_cli(*cmd[:-1], config, env=env)
    assert result.code == 2, result.stderr
    [line] = result.error_lines
    assert "no database configured: set INBOXD_DSN" in line and "INBOXD_EMBEDDED_PG=allow" in line
    assert not (data / "pg").exists()  # no server was initialised


def test_a_bad_embedded_policy_is_a_usage_error(tmp_path: Path) -> None:
    result = run_cli("db", "url", env=cli_env(tmp_path, INBOXD_EMBEDDED_PG="maybe"))
    assert result.code == 2 and 'INBOXD_EMBEDDED_PG must be "allow" or "refuse"' in result.stderr


def test_the_compose_file_wires_inboxd_to_the_applications_database() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    services, secrets, volumes = compose["services"], compose["secrets"], compose["volumes"]
    inboxd = services["inboxd"]
    assert inboxd["environment"]["INBOXD_DSN"].startswith("file:/run/secrets/")
    assert "INBOXD_EMBEDDED_PG" not in inboxd["environment"]
    assert (
        DEPLOY / "compose" / inboxd["build"]["context"] / inboxd["build"]["dockerfile"]
    ).is_file()
    assert inboxd["depends_on"]["postgres"]["condition"] == "service_healthy"
    for service in services.values():
        assert set(service.get("secrets", [])) <= set(secrets)
        for mount in service.get("volumes", []):
            source = mount.split(":", 1)[0]
            assert source.startswith((".", "/")) or source in volumes, mount
    assert all(port.startswith("127.0.0.1:") for port in inboxd["ports"])


def _kinds(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_the_kubernetes_sidecar_manifest_is_whole(tmp_path: Path) -> None:
    docs = [
        d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "sidecar.yaml").read_text()) if d
    ]
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
    objects = _kinds(docs)
    deployment = objects[("Deployment", "app")]
    pod = deployment["spec"]["template"]
    assert (
        deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    )
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    inboxd = containers["inboxd"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for mount in inboxd["volumeMounts"]:
        assert mount["name"] in volumes
    for volume in volumes.values():
        if "configMap" in volume:
            assert ("ConfigMap", volume["configMap"]["name"]) in objects
        if "persistentVolumeClaim" in volume:
            assert (
                "PersistentVolumeClaim",
                volume["persistentVolumeClaim"]["claimName"],
            ) in objects
    env = {e["name"]: e for e in inboxd["env"]}
    secret_env: dict[str, str] = {}
    for name, entry in env.items():
        ref = entry["valueFrom"]["secretKeyRef"]
        secret = objects[("Secret", ref["name"])]
        secret_env[name] = secret["stringData"][ref["key"]]
    assert "INBOXD_DSN" in env and "INBOXD_EMBEDDED_PG" not in env
    assert inboxd["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 8025}
    assert inboxd["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 8025}

    # The tenant files it mounts pass check-config with the secrets it passes.
    tenants = tmp_path / "tenants"
    tenants.mkdir()
    for name, text in objects[("ConfigMap", "inboxd-tenants")]["data"].items():
        (tenants / name).write_text(text)
    config = tmp_path / "inboxd.toml"
    config.write_text(f"[tenants]\ndir = {orjson.dumps(str(tenants)).decode()}\n")
    secret_env.pop("INBOXD_DSN")
    checked = run_cli("check-config", config, env=cli_env(tmp_path / "data", **secret_env))
    assert checked.code == 0, checked.stderr


def test_the_proxy_examples_expose_only_push_and_hooks() -> None:
    caddy = (DEPLOY / "proxy" / "Caddyfile").read_text()
    assert "@inboxd path /push/* /hooks/*" in caddy
    assert "handle @inboxd {" in caddy and "respond 404" in caddy
    nginx = (DEPLOY / "proxy" / "nginx.conf").read_text()
    locations = [ln.split("{")[0].strip() for ln in nginx.splitlines() if "location" in ln]
    locations = [ln for ln in locations if ln.startswith("location")]
    assert locations == ["location ~ ^/(push|hooks)/", "location /"]
    assert "return 404;" in nginx.split("location /")[-1]
    # The client's address as nginx saw it, never the client's own header.
    assert "proxy_set_header X-Forwarded-For $remote_addr;" in nginx
