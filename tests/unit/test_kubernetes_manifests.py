"""deploy/kubernetes: every manifest validates OFFLINE against Kubernetes' own schemas (kubernetes-validate, network
blocked), and the fleet's invariants hold: settings are real and shared (Redis), secrets only in the Secret, the
router runs with the fleet's flags and policy, probes use real routes, replicas get a GPU, Redis persists.

No cluster is involved: the manifests are never applied here."""
import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate  # the test extra installs it (with pyyaml)
import pytest
import yaml

from qwen_vllm_ext.config import ENV_PREFIX, SECRET_FIELDS, Settings
from qwen_vllm_ext.fleet.plan import DEFAULT_POLICY, HEALTH_PATH, ROUTER_FLAGS, ROUTER_READY_PATH
from qwen_vllm_ext.profiles import load_profile, profile_names

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
KUSTOMIZATION = "kustomization.yaml"
# A release many clusters still run, and the newest one the installed kubernetes-validate bundles.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())

CONFIGMAP, SECRET = "qwen-vllm-ext-settings", "qwen-vllm-ext-secrets"
REPLICA, ROUTER, REDIS = "qwen-replica", "qwen-router", "qwen-redis"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
WORKLOADS = ("Deployment", "StatefulSet")
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
NAMESPACE_PLACEHOLDER = "<pod namespace>"


# ---- loading -----------------------------------------------------------------------------------------------------
def _manifest_files():
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def _documents():
    """(file, document) for every non-empty YAML document under deploy/kubernetes."""
    out = []
    for path in _manifest_files():
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc:
                out.append((path, doc))
    return out


def _resources():
    return [(p, d) for p, d in _documents() if p.name != KUSTOMIZATION]


def _one(kind: str, name: str) -> dict:
    found = [d for _, d in _resources() if d.get("kind") == kind and d.get("metadata", {}).get("name") == name]
    assert len(found) == 1, f"expected exactly one {kind} {name!r} under deploy/kubernetes, found {len(found)}"
    return found[0]


def _container(workload: dict) -> dict:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: expected one container, got {len(containers)}"
    return containers[0]


def _kn(doc: dict) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def _settings_env() -> dict[str, str]:
    """What envFrom puts in a replica's environment: the ConfigMap's data and the Secret's values."""
    secret = _one("Secret", SECRET)
    return {**_one("ConfigMap", CONFIGMAP).get("data", {}), **secret.get("stringData", {}), **secret.get("data", {})}


def _container_env(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it (envFrom first, then env); a fieldRef to the pod's
    namespace reads as NAMESPACE_PLACEHOLDER."""
    sources = {("configMapRef", CONFIGMAP): _one("ConfigMap", CONFIGMAP).get("data", {})}
    secret = _one("Secret", SECRET)
    sources[("secretRef", SECRET)] = {**secret.get("stringData", {}), **secret.get("data", {})}
    env = {}
    for item in container.get("envFrom", []):
        (ref, value), = ((k, v) for k, v in item.items() if k in ("configMapRef", "secretRef"))
        assert (ref, value["name"]) in sources, f"{container['name']}: envFrom {ref} {value['name']!r} is not in deploy/kubernetes"
        env.update(sources[(ref, value["name"])])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        source = item["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            data = sources.get(("configMapRef", ref["name"]), {})
            assert ref["key"] in data, f"{container['name']}: env {item['name']} reads the missing key {ref['key']!r}"
            env[item["name"]] = data[ref["key"]]
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[item["name"]] = NAMESPACE_PLACEHOLDER
        else:
            env[item["name"]] = f"<{item['name']}>"
    return env


def _argv(container: dict) -> list[str]:
    """command + args with $(VAR) references expanded from the container's environment (as the kubelet does);
    a reference that does not resolve fails the test (the kubelet would pass it on literally)."""
    env = _container_env(container)
    argv = [*container.get("command", []), *container.get("args", [])]
    unresolved = sorted({m for token in argv for m in VAR_REF.findall(token) if m not in env})
    assert not unresolved, f"{container['name']}: $(...) references with no such environment variable: {unresolved}"
    return [VAR_REF.sub(lambda m: str(env[m.group(1)]), str(token)) for token in argv]


def _flag_value(argv: list[str], flag: str) -> str:
    positions = [i for i, token in enumerate(argv) if token == flag]
    assert len(positions) == 1, f"expected {flag} exactly once in {argv}, found it {len(positions)} times"
    assert positions[0] + 1 < len(argv), f"{flag} has no value in {argv}"
    return argv[positions[0] + 1]


def _port_names_and_numbers(container: dict) -> set:
    return {p.get("name") for p in container.get("ports", [])} | {p["containerPort"] for p in container.get("ports", [])}


def _gib(quantity) -> float:
    match = re.fullmatch(r"([0-9.]+)([KMGTE]i?)?", str(quantity))
    assert match, f"cannot read the quantity {quantity!r}"
    factor = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Ei": 2**60,
              "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "E": 1e18}[match.group(2)]
    return float(match.group(1)) * factor / 2**30


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test: the validation must work offline."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted during offline validation: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


# ---- schema -----------------------------------------------------------------------------------------------------
def test_the_manifests_exist():
    kinds = sorted(_kn(d) for _, d in _resources())
    assert len(kinds) >= 11, f"deploy/kubernetes holds too few resources: {kinds}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_offline_against_the_kubernetes_schema(version, no_network):
    errors, validated = [], set()
    for path, doc in _resources():
        where = f"{path.relative_to(ROOT)} {_kn(doc)}"
        try:
            validated.add(kubernetes_validate.validate(doc, version, strict=True))
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{where}: {'.'.join(map(str, exc.path)) or '<root>'}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:  # an unknown kind/apiVersion is an error here
            errors.append(f"{where}: {exc.message}")
    assert not errors, f"invalid for Kubernetes {version} (strict schema):\n" + "\n".join(errors)
    assert validated == {version.rsplit(".", 1)[0]}, f"validated against {validated}, asked for {version}"


def test_a_broken_manifest_is_caught_by_the_validation(no_network):
    """The validation is not vacuous: a typo'd field and a wrong type are both rejected."""
    deployment = _one("Deployment", REPLICA)
    typo = {**deployment, "spec": {**deployment["spec"], "replicaz": 2}}
    wrong_type = {**deployment, "spec": {**deployment["spec"], "replicas": "two"}}
    for broken in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_the_manifests_are_namespace_agnostic():
    pinned = [_kn(d) for _, d in _resources() if "namespace" in d.get("metadata", {})]
    assert not pinned, f"these resources hard-code a namespace (the user picks one with -n or an overlay): {pinned}"


def test_the_kustomization_lists_every_manifest_file():
    path = DEPLOY / KUSTOMIZATION
    assert path.is_file(), "deploy/kubernetes/kustomization.yaml is missing"
    kustomization = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert kustomization.get("apiVersion") == "kustomize.config.k8s.io/v1beta1", "kustomization: wrong apiVersion"
    assert kustomization.get("kind") == "Kustomization", "kustomization: wrong kind"
    listed = kustomization.get("resources", [])
    on_disk = sorted(str(p.relative_to(DEPLOY)) for p in _manifest_files() if p.name != KUSTOMIZATION)
    assert len(listed) == len(set(listed)), f"kustomization lists a file twice: {listed}"
    assert sorted(listed) == on_disk, (
        f"kustomization.yaml resources != manifest files: not listed {sorted(set(on_disk) - set(listed))}, "
        f"listed but missing {sorted(set(listed) - set(on_disk))}")


# ---- settings and secrets ------------------------------------------------------------------------------------------
def test_every_extension_key_names_a_real_setting():
    known = {ENV_PREFIX + name.upper() for name in Settings.field_names()}
    for kind, name in (("ConfigMap", CONFIGMAP), ("Secret", SECRET)):
        doc = _one(kind, name)
        keys = {*doc.get("data", {}), *doc.get("stringData", {})}
        unknown = sorted(k for k in keys if k.startswith(ENV_PREFIX) and k not in known)
        assert not unknown, f"{kind} {name}: these keys name no setting of Settings.field_names(): {unknown}"


def test_secrets_are_only_in_the_secret():
    secret_keys = {ENV_PREFIX + name.upper() for name in SECRET_FIELDS}
    leaked = sorted(secret_keys & set(_one("ConfigMap", CONFIGMAP).get("data", {})))
    assert not leaked, f"ConfigMap {CONFIGMAP} holds secrets (they belong in Secret {SECRET}): {leaked}"
    secret = _one("Secret", SECRET)
    values = {**secret.get("stringData", {}), **secret.get("data", {})}
    for name in ("gateway_secret", "admin_key", "metrics_key"):
        assert ENV_PREFIX + name.upper() in values, f"Secret {SECRET} lacks {ENV_PREFIX + name.upper()}"
    assert "HF_TOKEN" in values, f"Secret {SECRET} lacks the (optional) HF_TOKEN key"
    for _, doc in _resources():
        if doc["kind"] in WORKLOADS:
            for c in doc["spec"]["template"]["spec"]["containers"]:
                inline = sorted(e["name"] for e in c.get("env", []) if e["name"] in secret_keys and "value" in e)
                assert not inline, f"{_kn(doc)} container {c['name']} sets secrets inline: {inline}"


def test_the_replicas_guard_metrics_with_the_secret_metrics_key():
    """/metrics carries per-key series only behind the metrics key (issue 45): every replica reads it from the Secret,
    by name (a Secret without it stops the pod instead of serving /metrics without the per-key series)."""
    name = ENV_PREFIX + "METRICS_KEY"
    env = {e["name"]: e for e in _container(_one("Deployment", REPLICA)).get("env", [])}
    assert name in env, f"Deployment {REPLICA} does not read {name}"
    ref = env[name].get("valueFrom", {}).get("secretKeyRef", {})
    assert (ref.get("name"), ref.get("key"), ref.get("optional", False)) == (SECRET, name, False), env[name]
    settings = Settings.resolve(env=_settings_env())
    assert settings.gateway and settings.metrics_key, "the fleet's /metrics would be public without the per-key series"


def test_replicas_share_their_state_through_redis():
    from qwen_vllm_ext.store.locations import shared_state_problem

    settings = Settings.resolve(env=_settings_env())
    assert settings.ledger_backend == "redis", f"ledger_backend is {settings.ledger_backend!r}, a fleet needs redis"
    assert settings.limiter_backend == "redis", f"limiter_backend is {settings.limiter_backend!r}, a fleet needs redis"
    assert settings.limiter_failure == "closed", f"limiter_failure is {settings.limiter_failure!r}, expected closed"
    assert settings.require_shared_state is True, "require_shared_state is not true in the ConfigMap"
    assert settings.gateway is True, "the gateway is not on in the ConfigMap"
    assert shared_state_problem(settings) is None, shared_state_problem(settings)
    url = urlsplit(settings.limiter_redis_url or settings.ledger_redis_url)
    service = _one("Service", REDIS)
    assert url.hostname == service["metadata"]["name"], f"the Redis URL's host {url.hostname!r} is not Service {REDIS}"
    assert url.port in {p["port"] for p in service["spec"]["ports"]}, f"the Redis URL's port {url.port} is not a port of {REDIS}"


# ---- router -----------------------------------------------------------------------------------------------------
def _router_argv() -> list[str]:
    argv = _argv(_container(_one("Deployment", ROUTER)))
    assert argv and argv[0] == "vllm-router", f"the router container does not run vllm-router: {argv[:3]}"
    return argv


def test_the_router_runs_every_fleet_flag_in_order():
    argv, flags, n = _router_argv(), list(ROUTER_FLAGS), len(ROUTER_FLAGS)
    assert any(argv[i:i + n] == flags for i in range(len(argv) - n + 1)), (
        f"the router's args do not contain qwen_vllm_ext.fleet.plan.ROUTER_FLAGS as one run:\n"
        f"  expected {flags}\n  got      {argv}")


def test_the_router_policy_is_the_fleet_default():
    policy = _flag_value(_router_argv(), "--policy")
    assert policy == DEFAULT_POLICY, f"router --policy is {policy!r}, qwen_vllm_ext.fleet.plan.DEFAULT_POLICY is {DEFAULT_POLICY!r}"


def test_vllm_router_accepts_the_args_and_discovers_the_replicas():
    """The real vllm-router argument parser reads the args (an unknown flag is an error) and the discovery settings
    point at the replica pods, in the router's own namespace, on the replicas' port."""
    from vllm_router.launch_router import parse_router_args  # the fleet extra installs vllm-router

    argv = _router_argv()
    try:
        args = parse_router_args(argv[1:])
    except SystemExit:
        pytest.fail(f"vllm-router rejects the router's args (see stderr): {argv[1:]}")
    replica = _one("Deployment", REPLICA)
    labels = replica["spec"]["template"]["metadata"]["labels"]
    replica_ports = {p["containerPort"] for p in _container(replica)["ports"]}
    router_ports = {p["name"]: p["containerPort"] for p in _container(_one("Deployment", ROUTER))["ports"]}
    assert args.service_discovery, "the router's --service-discovery is off"
    assert args.selector and all(labels.get(k) == v for k, v in args.selector.items()), (
        f"the router's --selector {args.selector} does not match the replica pod labels {labels}")
    assert args.selector.items() <= replica["spec"]["selector"]["matchLabels"].items(), (
        f"the router's --selector {args.selector} is not the replica Deployment's selector")
    assert args.service_discovery_port in replica_ports, (
        f"--service-discovery-port {args.service_discovery_port} is not a replica container port {replica_ports}")
    assert args.service_discovery_namespace == NAMESPACE_PLACEHOLDER, (
        "--service-discovery-namespace must be the router pod's own namespace (downward API): the Role only "
        "grants that namespace")
    assert args.host == "0.0.0.0" and args.port == router_ports["http"], "the router listens elsewhere than its http port"
    assert args.prometheus_host == "0.0.0.0" and args.prometheus_port == router_ports["metrics"], (
        "the router's metrics are not on its metrics port")
    assert args.disable_retries and args.disable_circuit_breaker, "retries or the circuit breaker are on"
    assert args.health_check_endpoint == "/health", f"the router checks replicas on {args.health_check_endpoint!r}"


def test_the_router_may_list_and_watch_pods():
    deployment = _one("Deployment", ROUTER)
    account = deployment["spec"]["template"]["spec"].get("serviceAccountName")
    assert account, "the router Deployment sets no serviceAccountName"
    _one("ServiceAccount", account)
    bindings = [d for _, d in _resources() if d["kind"] == "RoleBinding"
                and any(s.get("kind") == "ServiceAccount" and s.get("name") == account for s in d.get("subjects", []))]
    assert bindings, f"no RoleBinding binds ServiceAccount {account}"
    verbs = set()
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role", f"{_kn(binding)} binds a {binding['roleRef']['kind']}, not a Role"
        for rule in _one("Role", binding["roleRef"]["name"]).get("rules", []):
            if "" in rule.get("apiGroups", []) and "pods" in rule.get("resources", []):
                verbs |= set(rule.get("verbs", []))
    assert {"get", "list", "watch"} <= verbs, f"the router's Role grants {sorted(verbs)} on pods, needs get/list/watch"


# ---- probes, command, resources ---------------------------------------------------------------------------------
ROUTER_PROBES = {"readinessProbe": ROUTER_READY_PATH, "livenessProbe": "/liveness"}


@pytest.mark.parametrize("name,probes", [(REPLICA, dict.fromkeys(PROBES, HEALTH_PATH)), (ROUTER, ROUTER_PROBES)])
def test_probes_use_the_real_routes_on_the_container_port(name, probes):
    container = _container(_one("Deployment", name))
    ports = _port_names_and_numbers(container)
    for probe, path in probes.items():
        assert probe in container, f"{name}: no {probe}"
        get = container[probe].get("httpGet")
        assert get, f"{name}: {probe} is not an HTTP GET"
        assert get.get("path") == path, f"{name}: {probe} GETs {get.get('path')!r}, the real route is {path}"
        assert get.get("port") in ports, f"{name}: {probe} targets port {get.get('port')!r}, not one of {ports}"
    for probe in set(PROBES) - set(probes):
        assert probe not in container, f"{name}: unexpected {probe}"


def test_the_replica_startup_probe_waits_for_the_model_to_load():
    probe = _container(_one("Deployment", REPLICA))["startupProbe"]
    budget = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    assert budget >= 600, f"the replica's startupProbe gives up after {budget} s; loading a model takes minutes"


def _replica_launcher_args():
    """(launcher options, the rest: vLLM's flags) of the replica's command."""
    from qwen_vllm_ext.serve import launcher_parser

    argv = _argv(_container(_one("Deployment", REPLICA)))
    assert argv[1:3] == ["-m", "qwen_vllm_ext.serve"] and argv[0].startswith("python"), (
        f"the replica does not run python -m qwen_vllm_ext.serve: {argv[:3]}")
    return launcher_parser().parse_known_args(argv[3:])


def test_the_replica_runs_the_launcher_with_a_real_gpu_profile():
    container = _container(_one("Deployment", REPLICA))
    ours, rest = _replica_launcher_args()
    assert ours.profile in profile_names(), f"--profile {ours.profile!r} is not one of {profile_names()}"
    assert load_profile(ours.profile).device == "cuda", f"--profile {ours.profile!r} is not a GPU profile"
    assert _flag_value(rest, "--model"), "the replica passes no --model"
    assert _flag_value(rest, "--host") == "0.0.0.0", "the replica does not listen on 0.0.0.0"
    port = int(_flag_value(rest, "--port"))
    assert port in {p["containerPort"] for p in container["ports"] if p.get("name") == "http"}, (
        f"the replica's --port {port} is not its http container port")
    assert _one("Deployment", REPLICA)["spec"]["template"]["spec"].get("terminationGracePeriodSeconds") == 60


def test_each_replica_requests_one_gpu_and_enough_host_memory():
    container = _container(_one("Deployment", REPLICA))
    resources = container.get("resources", {})
    for part in ("requests", "limits"):
        gpus = resources.get(part, {}).get("nvidia.com/gpu")
        assert str(gpus) == "1", f"the replica's resources.{part} has nvidia.com/gpu {gpus!r}, expected 1"
    requests = resources["requests"]
    assert "cpu" in requests and "memory" in requests, "the replica requests no cpu or no memory"
    profile = load_profile(_replica_launcher_args()[0].profile)
    pinned = float(profile.vllm.get("kv-offloading-size", 0))
    assert _gib(requests["memory"]) > pinned, (
        f"the replica requests {requests['memory']} of memory; profile {profile.name} pins {pinned:g} GiB of host "
        "RAM for KV offloading alone")
    spec = _one("Deployment", REPLICA)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    assert "/dev/shm" in mounts and volumes[mounts["/dev/shm"]].get("emptyDir", {}).get("medium") == "Memory", (
        "the replica has no in-memory emptyDir at /dev/shm")
    data_dir = Settings.resolve(env=_settings_env()).data_dir
    assert any(data_dir == m or data_dir.startswith(m.rstrip("/") + "/") for m in mounts), (
        f"data_dir {data_dir} is not on a mounted volume")


# ---- Redis, services, images --------------------------------------------------------------------------------------
def test_redis_persists_to_a_volume_claim():
    statefulset = _one("StatefulSet", REDIS)
    claims = {c["metadata"]["name"]: c for c in statefulset["spec"].get("volumeClaimTemplates", [])}
    assert claims, f"StatefulSet {REDIS} has no volumeClaimTemplates: Redis would lose the ledger on restart"
    container = _container(statefulset)
    args = [*container.get("command", []), *container.get("args", [])]
    assert _flag_value(args, "--appendonly") == "yes", "Redis does not run with --appendonly yes"
    directory = _flag_value(args, "--dir")
    mounted = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    assert mounted.get(directory) in claims, f"Redis --dir {directory} is not a volume claim's mount"
    storage = claims[mounted[directory]]["spec"]["resources"]["requests"]["storage"]
    assert _gib(storage) >= 1, f"the Redis volume claim asks for only {storage}"
    command = " ".join(container.get("readinessProbe", {}).get("exec", {}).get("command", []))
    assert "redis-cli ping" in command, f"Redis's readinessProbe does not run redis-cli ping: {command!r}"


def test_every_service_selects_a_workload_and_targets_its_ports():
    workloads = [d for _, d in _resources() if d["kind"] in WORKLOADS]
    for _, service in _resources():
        if service["kind"] != "Service":
            continue
        selector = service["spec"].get("selector", {})
        matching = [w for w in workloads if selector
                    and selector.items() <= w["spec"]["template"]["metadata"].get("labels", {}).items()]
        assert matching, f"Service {service['metadata']['name']} selects no pods of deploy/kubernetes ({selector})"
        ports = set().union(*(_port_names_and_numbers(c) for w in matching
                              for c in w["spec"]["template"]["spec"]["containers"]))
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in ports, f"Service {service['metadata']['name']} targets port {target!r}, not one of {ports}"
    router = _one("Service", ROUTER)
    assert router["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert {(p["port"], p.get("targetPort")) for p in router["spec"]["ports"]} >= {(80, "http")}, (
        f"Service {ROUTER} does not map port 80 to the router's http port")


def test_the_dockerfile_builds_the_images_the_manifests_run():
    text = DOCKERFILE.read_text(encoding="utf-8")
    stages = {alias: image for image, alias in re.findall(r"(?im)^FROM\s+(\S+)\s+AS\s+(\S+)\s*$", text)}
    assert stages.get("replica", "").startswith("vllm/vllm-openai:"), f"no replica stage FROM vllm/vllm-openai: {stages}"
    assert stages.get("router", "").startswith("python:"), f"no router stage FROM python: {stages}"
    pin = re.search(r"vllm-router==([0-9][^\s\"']*)", text)
    assert pin, "the router stage does not pin vllm-router"
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f"vllm-router=={pin.group(1)}" in pyproject, (
        f"the Dockerfile installs vllm-router=={pin.group(1)}, pyproject.toml pins another version")
    images = {d["metadata"]["name"]: _container(d)["image"] for _, d in _resources() if d["kind"] == "Deployment"}
    assert images == {REPLICA: "qwen-vllm-ext:latest", ROUTER: "qwen-vllm-router:latest"}, images
