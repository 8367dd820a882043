"""The container image: what the Dockerfile says, the wheel it builds, the `kubevbmc` entry point with the runtime
dependencies only (as the Deployments call it), and the image itself, built by `make image` (scripts/image.py) and
run with podman: its user, packages and labels, and `kubevbmc agent` from it powering a VM for ipmitool."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from controller import desired, settings
from controller.settings import Settings

from ..support.agents import PASSWORD, USER, ipmitool_at
from ..support.cluster import REPO, STOP_DEADLINE, Sim, wait_for
from ..support.containers import image_config, podman
from ..support.vms import make_vm, printable

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
[(SCRIPT, SCRIPT_TARGET)] = PROJECT["scripts"].items()
CRD = REPO / "controller" / "crds" / "bmc.kubevirt.io_virtualmachinebmcs.yaml"


# ---- the Dockerfile, read as Docker reads it


@dataclass
class Stage:
    image: str
    name: str = ""
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [arg for kw, arg in self.instructions if kw == keyword]

    def one(self, keyword: str) -> str:
        found = self.all(keyword)
        assert len(found) == 1, f"expected one {keyword} in the stage FROM {self.image}, found {found}"
        return found[0]


def dockerfile_stages(text: str) -> tuple[dict[str, str], list[Stage]]:
    """The global ARGs (before the first FROM) and the instructions by stage: comments dropped, backslash
    continuations joined, keywords upper-cased, ${ARG} in FROM replaced by the global ARG's default."""
    logical, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip():
            logical.append(" ".join(current.split()))
        current = ""
    stages: list[Stage] = []
    global_args: dict[str, str] = {}
    for entry in logical:
        keyword, _, argument = entry.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = argument.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            image = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], words[0])
            stages.append(Stage(image, name))
        elif not stages:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            key, _, default = argument.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append((keyword, argument))
    return global_args, stages


GLOBAL_ARGS, STAGES = dockerfile_stages((REPO / "Dockerfile").read_text())
BUILDER, FINAL = STAGES[0], STAGES[-1]


def exec_form(argument: str) -> list[str]:
    """An ENTRYPOINT or CMD in exec (JSON) form: no shell between the container and the process."""
    value = json.loads(argument)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), argument
    return value


def labels(stage: Stage) -> dict[str, str]:
    found: dict[str, str] = {}
    for argument in stage.all("LABEL"):
        for item in shlex.split(argument):
            key, _, value = item.partition("=")
            found[key] = value
    return found


def build_args(stage: Stage) -> dict[str, str]:
    return dict(arg.partition("=")[::2] for arg in stage.all("ARG"))


def test_the_dockerfile_is_multi_stage_on_debians_own_slim_image() -> None:
    assert len(STAGES) >= 2 and BUILDER.name, "a named builder stage, then the final stage"
    assert FINAL.name == "" or FINAL.name != BUILDER.name
    # Debian's image and Debian's Python: what scripts/image.py makes from Debian's packages where the image cannot
    # be pulled is the same thing, so the image tested here is the one released.
    repository, _, tag = FINAL.image.partition(":")
    assert repository == "docker.io/library/debian" and tag.endswith("-slim"), FINAL.image
    assert "@" not in FINAL.image and "latest" not in tag and tag.removesuffix("-slim").isalpha(), \
        "a Debian release's codename, not a moving tag"
    # The virtualenv copied from the builder runs the base's /usr/bin/python3: the same base in both stages, and the
    # final stage installs Debian's python3 (the built image's interpreter is checked against requires-python).
    assert BUILDER.image == FINAL.image
    assert any(r.split()[:1] == ["debian-packages"] and "python3" in r.split() for r in FINAL.all("RUN"))


def test_the_builder_installs_a_wheel_of_the_project_with_the_constraints_and_no_extras() -> None:
    runs = BUILDER.all("RUN")
    wheel = [r for r in runs if "pip wheel" in r]
    assert wheel and "--no-deps" in wheel[0].split(), "the wheel holds the project only"
    installs = [shlex.split(r.split("&&")[-1]) for r in runs if "pip install" in r]
    assert len(installs) == 2, runs
    dependencies, project = installs
    for install in installs:
        constraint = next(install[i + 1] for i, word in enumerate(install) if word in ("-c", "--constraint"))
        assert constraint == "constraints.txt"
    # First the pinned runtime dependencies, read from pyproject.toml (a layer that a code change keeps), then the
    # wheel without resolving anything again.
    assert "--requirement" in dependencies and "'dependencies'" in next(r for r in runs if "pip install" in r)
    assert "--no-deps" in project
    targets = [w for w in project[project.index("install") + 1:] if not w.startswith("-") and w != "constraints.txt"]
    assert targets and all(t.endswith(".whl") for t in targets), targets
    for run in BUILDER.all("RUN") + FINAL.all("RUN"):
        assert not re.search(r"\[(sim|test|bench)", run), f"no extras in the image: {run}"
    assert not any("pip" in r for r in FINAL.all("RUN")), "the final stage installs nothing from PyPI"


def test_the_final_stage_runs_the_console_script_as_a_numeric_non_root_user() -> None:
    entrypoint = exec_form(FINAL.one("ENTRYPOINT"))
    assert len(entrypoint) == 1 and Path(entrypoint[0]).name == SCRIPT
    # The script lives in the virtualenv the builder made and the final stage copied.
    venv = str(Path(entrypoint[0]).parent.parent)
    assert any(shlex.split(r) == ["python3", "-m", "venv", venv] for r in BUILDER.all("RUN"))
    assert any(c.split() == ["--from=" + BUILDER.name, venv, venv] for c in FINAL.all("COPY"))
    for cmd in FINAL.all("CMD"):
        exec_form(cmd)
    user = FINAL.one("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0 and (not gid or (gid.isdigit() and int(gid) > 0)), user
    assert all("sh -c" not in arg for _, arg in FINAL.instructions)


def agent_deployment(ipmi: bool = True, tls: bool = True) -> dict[str, Any]:
    bmc = {"apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC",
           "metadata": {"name": "vm-1", "namespace": "default", "uid": "u-1"},
           "spec": {"virtualMachineRef": {"name": "vm-1"}, "authSecretRef": {"name": "vm-1-auth"},
                    "ipmi": {"enabled": ipmi}}}
    secret = {"metadata": {"name": "vm-1-auth"}, "data": {"username": "YWRtaW4=", "password": "cGFzcw=="}}
    tls_secret = {"metadata": {"name": "vm-1-virtbmc-tls"}, "data": {"tls.crt": "Yw==", "tls.key": "aw=="}}
    return desired.desired_deployment(bmc, "vm-1", Settings(), secret, tls_secret if tls else None)


def agent_container(ipmi: bool = True, tls: bool = True) -> dict[str, Any]:
    [container] = agent_deployment(ipmi, tls)["spec"]["template"]["spec"]["containers"]
    return container


def test_the_image_exposes_the_ports_the_agent_containers_declare() -> None:
    exposed = {port for argument in FINAL.all("EXPOSE") for port in argument.split()}
    declared = {f"{p['containerPort']}/{p['protocol'].lower()}" for p in agent_container()["ports"]}
    assert exposed == declared
    assert all(int(p.split("/")[0]) > 1024 for p in exposed), "unprivileged ports: the agent runs as non-root"


def test_the_labels_are_the_projects() -> None:
    found = labels(FINAL)
    assert found["org.opencontainers.image.title"] == PROJECT["name"]
    assert found["org.opencontainers.image.description"] == PROJECT["description"]
    assert found["org.opencontainers.image.licenses"] == PROJECT["license"]
    assert found["org.opencontainers.image.version"] == "${VERSION}"
    assert build_args(FINAL)["VERSION"] == PROJECT["version"]
    assert found["org.opencontainers.image.base.name"] == "${BASE}" and "BASE" in build_args(FINAL)


def test_the_pod_security_contexts_match_the_image_user() -> None:
    uid, _, gid = FINAL.one("USER").partition(":")
    pod = agent_deployment()["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(uid)
    assert pod["securityContext"]["runAsGroup"] == int(gid or uid)
    # The kubelet gives the mounted TLS Secret (0440) to this group: without it the key is root's alone.
    assert pod["securityContext"]["fsGroup"] == int(gid or uid)


# ---- .dockerignore, matched as Docker matches it (patterns from the context root, `**`, `!` exceptions)


def _pattern(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i:end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        rules.append((negated, _pattern(os.path.normpath(line.lstrip("!")).lstrip("/"))))
    return rules


def excluded(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]  # a directory's rule covers its files
    result = False
    for negated, rule in rules:
        if any(rule.fullmatch(c) for c in candidates):
            result = not negated
    return result


def copied_sources() -> list[str]:
    """The context paths the builder COPYs (the last word of each COPY is its destination)."""
    sources = []
    for argument in BUILDER.all("COPY"):
        words = [w for w in argument.split() if not w.startswith("--")]
        sources += [w.rstrip("/") for w in words[:-1]]
    return sources


def context_files(sources: list[str]) -> Iterator[str]:
    for source in sources:
        path = REPO / source
        if path.is_file():
            yield source
            continue
        for file in sorted(path.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts:
                yield file.relative_to(REPO).as_posix()


@pytest.mark.parametrize("path", [".venv/bin/python", ".git/HEAD", ".pytest_cache/v/cache/nodeids",
                                  "vbmc/__pycache__/cli.cpython-311.pyc", "kubevbmc.egg-info/PKG-INFO",
                                  ".mypy_cache/3.11/x.json", ".ruff_cache/content", "tests/project/test_image.py",
                                  "bench/agent.py", "charts/kubevbmc/Chart.yaml", "run/sim.log",
                                  "demo/kubesim.kubeconfig"])
def test_dockerignore_keeps_local_state_out_of_the_context(path: str) -> None:
    assert excluded(path, dockerignore())


def test_dockerignore_keeps_everything_the_builder_copies() -> None:
    rules = dockerignore()
    files = list(context_files(copied_sources()))
    assert {"pyproject.toml", "README.md", "constraints.txt", "vbmc/cli.py", CRD.relative_to(REPO).as_posix()} <= set(
        files)
    assert [f for f in files if excluded(f, rules)] == []


# ---- the wheel, built the way the builder stage builds it


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The builder's context (its COPY sources, minus what .dockerignore drops) in a directory of its own, and its
    `pip wheel` RUN line run there: the working tree gets no build/ or egg-info from it."""
    root = tmp_path_factory.mktemp("image")
    context, wheels = root / "src", root / "wheels"
    rules = dockerignore()
    for name in context_files(copied_sources()):
        if not excluded(name, rules):
            (context / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, context / name)
    [command] = [shlex.split(r) for r in BUILDER.all("RUN") if "pip wheel" in r]
    assert Path(command[0]).name == "pip" and command[1] == "wheel"
    command = ["pip", *command[1:]]
    destination = command[command.index("--wheel-dir") + 1]
    args = [wheels.as_posix() if word == destination else word for word in command[1:]]
    built = subprocess.run([sys.executable, "-m", "pip", *args, "--quiet"], cwd=context, capture_output=True,
                           text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    [found] = wheels.glob("*.whl")
    return found


def test_the_wheel_holds_the_three_packages_and_the_crds(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        crd = archive.read("controller/crds/" + CRD.name)
    for package in ("vbmc", "controller", "kubesim", "vbmc/ipmi", "vbmc/redfish"):
        assert f"{package}/__init__.py" in names, package
    assert crd == CRD.read_bytes(), "the CRD in the image is the controller's one source"
    for kubesim_crd in (REPO / "kubesim" / "crds").glob("*.yaml"):
        assert f"kubesim/crds/{kubesim_crd.name}" in names
    assert not any(n.startswith(("tests/", "bench/", "charts/", "docs/")) for n in names)


def test_the_wheel_declares_the_console_script_and_pinned_runtime_dependencies(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        info = next(n.split("/")[0] for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        meta = archive.read(f"{info}/METADATA").decode()
    assert f"{SCRIPT} = {SCRIPT_TARGET}" in entry_points.split("[console_scripts]")[1].splitlines()
    requires = [Requirement(line.split(":", 1)[1].strip()) for line in meta.splitlines()
                if line.startswith("Requires-Dist:")]
    runtime = {canonicalize_name(r.name): str(r.specifier) for r in requires
               if r.marker is None or r.marker.evaluate({"extra": ""})}
    assert runtime == {canonicalize_name(Requirement(d).name): str(Requirement(d).specifier)
                       for d in PROJECT["dependencies"]}
    # The builder installs with -c constraints.txt: every runtime dependency is pinned there at the same version.
    pins = {canonicalize_name(Requirement(line).name): str(Requirement(line).specifier)
            for line in (REPO / "constraints.txt").read_text().splitlines() if line.strip() and line[0] != "#"}
    assert {name: pins.get(name) for name in runtime} == runtime


# ---- the entry point, with only the runtime dependencies importable (what the image holds)


def _closure(requirements: list[str], leave_out: frozenset[str] = frozenset()) -> set[str]:
    """Installed distributions these requirements pull in (their own extras' requirements excluded), without
    `leave_out` and what only they pull in."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or name in leave_out:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for sub in dist.requires or []:
            parsed = Requirement(sub)
            if parsed.marker is None or parsed.marker.evaluate({"extra": ""}):
                todo.append(parsed)
    return seen


# The asyncio client the kubernetes package carries, and what it requires for it alone: the builder removes them.
ASYNC_CLIENT = frozenset({"aiohttp", "aiohttp-retry"})


def image_distributions() -> set[str]:
    """The runtime closure as the image holds it: without the asyncio client's requirements."""
    return _closure(PROJECT["dependencies"], ASYNC_CLIENT)


def extras_only_modules() -> list[str]:
    """Top-level modules that only the sim, test and bench extras (or the removed asyncio client) bring: absent from
    the image; and the asyncio client's package, kubernetes.aio."""
    runtime = image_distributions()
    extras = _closure([r for group in PROJECT["optional-dependencies"].values() for r in group]) - runtime
    extras |= _closure(PROJECT["dependencies"]) - runtime
    assert {"cel-python", "pytest", "sushy", "aiohttp"} <= extras
    return [*sorted(module for module, dists in metadata.packages_distributions().items()
                    if all(canonicalize_name(d) in extras for d in dists) and module.isidentifier()),
            "kubernetes.aio"]


def test_the_builder_removes_the_asyncio_client_and_exactly_what_only_it_needs() -> None:
    [removal] = [r for r in BUILDER.all("RUN") if "kubernetes/aio" in r]
    uninstall = shlex.split(removal.split("&&")[1])
    names = {canonicalize_name(w) for w in uninstall[uninstall.index("uninstall") + 1:] if not w.startswith("-")}
    assert names == _closure(PROJECT["dependencies"]) - image_distributions()


# Runs `kubevbmc` (vbmc.cli:main, the console script) with every extras-only module refused at import.
RUNTIME_ONLY = """
import importlib.abc, sys
blocked = set(sys.argv.pop(1).split(","))
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if any(name == b or name.startswith(b + ".") or name.partition(".")[0] == b for b in blocked):
            raise ModuleNotFoundError(f"No module named {name!r} (not in the image)", name=name)
        return None
sys.meta_path.insert(0, Refuse())
sys.argv[0] = "kubevbmc"
from vbmc.cli import main
sys.exit(main())
"""


def kubevbmc(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", RUNTIME_ONLY, ",".join(extras_only_modules()), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=REPO,
                          env={**os.environ, **(env or {})})


def test_the_installed_console_script_is_the_entry_point() -> None:
    script = Path(sys.executable).parent / SCRIPT
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {SCRIPT}")
    for command in ("agent", "controller"):
        assert command in result.stdout


def test_agent_help_lists_every_flag_the_agent_deployment_passes() -> None:
    result = kubevbmc("agent", "--help")
    assert result.returncode == 0, result.stderr
    container = agent_container()
    assert "command" not in container, "the Deployment relies on the image's entry point"
    assert container["args"][0] == "agent"
    flags = {a for a in container["args"] if a.startswith("--")}
    assert flags >= {"--namespace", "--vm", "--vmbmc", "--ipmi-address", "--redfish-address",
                     "--redfish-tls-address", "--tls-cert", "--tls-key"}
    for flag in flags:
        assert re.search(rf"{flag}\b", result.stdout), f"{flag} is not in `kubevbmc agent --help`"


def test_controller_help_lists_every_controller_flag() -> None:
    result = kubevbmc("controller", "--help")
    assert result.returncode == 0, result.stderr
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    flags = {s for action in parser._actions for s in action.option_strings if s.startswith("--") and s != "--help"}
    assert {"--kubeconfig", "--agent-image", "--namespace", "--metrics-address", "--leader-elect",
            "--log-level"} <= flags
    for flag in flags:
        assert re.search(rf"{flag}\b", result.stdout), f"{flag} is not in `kubevbmc controller --help`"


def test_an_unknown_subcommand_fails_with_a_usage_message() -> None:
    result = kubevbmc("frobnicate")
    assert result.returncode != 0
    assert result.stderr.startswith("usage: kubevbmc")
    assert "invalid choice: 'frobnicate'" in result.stderr


@pytest.mark.parametrize(("command", "variable", "value", "message"), [
    ("controller", "KUBEVBMC_DEFAULT_SERVICE_TYPE", "Bogus",
     "argument --default-service-type: invalid choice: 'Bogus'"),
    ("controller", "KUBEVBMC_LOG_FORMAT", "xml", "argument --log-format: invalid choice: 'xml'"),
    ("controller", "KUBEVBMC_WORKERS", "many", "argument --workers: invalid int value: 'many'"),
    ("agent", "VBMC_BACKEND", "libvirt", "argument --backend: invalid choice: 'libvirt'"),
    ("agent", "VBMC_REDFISH", "maybe", "argument --redfish: invalid choice: 'maybe'"),
    ("controller", "KUBEVBMC_AGENT_IMAGE_PULL_SECRETS", "registry,My_Registry",
     "argument --agent-image-pull-secrets: not a Secret name (lowercase letters, digits, '-' and '.'): "
     "'My_Registry'"),
])
def test_a_bad_value_from_the_environment_is_refused_like_a_bad_flag(command: str, variable: str, value: str,
                                                                      message: str) -> None:
    result = kubevbmc(command, env={variable: value})
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion of container args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def test_the_agent_accepts_the_deployments_args_and_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from vbmc.agent import command as agent

    container = agent_container()
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    assert {"VBMC_USERNAME", "VBMC_PASSWORD", "POD_IP", "POD_NAMESPACE"} <= set(env)
    env.update(POD_IP="10.0.0.7", POD_NAMESPACE="ns-1", VBMC_USERNAME="admin", VBMC_PASSWORD="pass")
    for key in ("tls.crt", "tls.key"):
        (tmp_path / key).write_text("pem")
    args = [expand(a, env).replace(desired.TLS_DIR, str(tmp_path)) for a in container["args"][1:]]
    for name in ("VBMC_USERNAME", "VBMC_PASSWORD"):
        monkeypatch.setenv(name, env[name])
    parser = argparse.ArgumentParser()
    agent.add_arguments(parser)
    config = agent.config_from(parser.parse_args(args))
    assert (config.namespace, config.vm, config.vmbmc) == ("ns-1", "vm-1", "vm-1")
    assert config.ipmi_address == f"10.0.0.7:{desired.IPMI_PORT}"
    assert config.redfish_address == f"10.0.0.7:{desired.HTTP_PORT}"
    assert config.redfish_tls_address == f"10.0.0.7:{desired.HTTPS_PORT}"
    assert (config.username, config.password) == ("admin", "pass")


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_agent_serves_and_stops_with_only_the_runtime_dependencies() -> None:
    ipmi, http = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_STREAM)
    command = [sys.executable, "-c", RUNTIME_ONLY, ",".join(extras_only_modules()), "agent", "--backend", "memory",
               "--vm", "vm-1", "--ipmi-address", f"127.0.0.1:{ipmi}", "--redfish-address", f"127.0.0.1:{http}"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env={**os.environ, "VBMC_USERNAME": "admin", "VBMC_PASSWORD": "password"})
    try:
        def ready() -> bool:
            assert proc.poll() is None, "the agent exited"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/readyz", timeout=1) as resp:
                    return bool(resp.status == 200)
            except OSError:
                return False

        wait_for(ready, timeout=15, what="the agent's /readyz")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STOP_DEADLINE) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
    assert "not in the image" not in output, output


# ---- the image, built by `make image` (scripts/image.py) and run with podman


def in_image(image: str, *args: str, entrypoint: str | None = None) -> subprocess.CompletedProcess[str]:
    """`podman run` of the image as a Deployment runs it: its user, a read-only root, no capabilities."""
    options = ["--rm", "--network", "host", "--read-only", "--read-only-tmpfs=false", "--cap-drop", "ALL",
               "--security-opt", "no-new-privileges", *podman().limits]
    if entrypoint:
        options += ["--entrypoint", entrypoint]
    return podman().call("run", *options, image, *args, timeout=120)


def test_the_built_image_runs_kubevbmc_as_its_numeric_user(kubevbmc_image: str) -> None:
    found = image_config(kubevbmc_image)
    config = found["Config"]
    assert config["User"] == FINAL.one("USER")
    assert config["Entrypoint"] == exec_form(FINAL.one("ENTRYPOINT"))
    assert set(config["ExposedPorts"]) == {p for argument in FINAL.all("EXPOSE") for p in argument.split()}
    assert config["Labels"]["org.opencontainers.image.version"] == PROJECT["version"]
    assert config["Labels"]["org.opencontainers.image.base.name"] == GLOBAL_ARGS["BASE"]
    # SOURCE_DATE_EPOCH, the last commit's time: the image's timestamp does not depend on when it was built.
    commit = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%ct"], capture_output=True, text=True)
    if commit.returncode == 0:
        created = found["Created"].replace("Z", "+00:00")
        assert int(datetime.datetime.fromisoformat(created).timestamp()) == int(commit.stdout)
    result = in_image(kubevbmc_image, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {SCRIPT}")


def test_the_image_lists_its_packages_pinned_as_constraints_txt_pins_them(kubevbmc_image: str) -> None:
    listed = in_image(kubevbmc_image, "-c", "import sys; [print(open(f).read()) for f in sys.argv[1:]]",
                      "/opt/kubevbmc/share/kubevbmc/python-packages.txt",
                      "/opt/kubevbmc/share/kubevbmc/debian-packages.txt", entrypoint="/opt/kubevbmc/bin/python")
    assert listed.returncode == 0, listed.stderr
    python_part, debian_part = listed.stdout.split("\n\n", 1)
    installed = {canonicalize_name(name): version for name, _, version in
                 (line.partition("==") for line in python_part.splitlines() if line)}
    pins = {canonicalize_name(Requirement(line).name): str(Requirement(line).specifier).removeprefix("==")
            for line in (REPO / "constraints.txt").read_text().splitlines() if line.strip() and line[0] != "#"}
    assert installed.pop("kubevbmc") == PROJECT["version"]
    assert "pip" not in installed and "setuptools" not in installed, "nothing in the image installs at run time"
    assert {name: pins.get(name) for name in installed} == installed, "every package at constraints.txt's pin"
    assert set(installed) == image_distributions(), "the runtime dependencies, without the asyncio client's"
    assert not {"cel-python", "pytest", "sushy"} & set(installed), "no extras"
    debian = dict(line.split("=", 1) for line in debian_part.splitlines() if line)
    assert {"python3", "python3.11", "ca-certificates", "libc6"} <= set(debian)


def test_the_images_python_is_the_one_the_project_requires(kubevbmc_image: str) -> None:
    found = in_image(kubevbmc_image, "-c", "import sys; print(*sys.version_info[:2])",
                     entrypoint="/opt/kubevbmc/bin/python")
    assert found.returncode == 0, found.stderr
    minimum = tuple(int(part) for part in PROJECT["requires-python"].removeprefix(">=").split("."))
    assert tuple(map(int, found.stdout.split())) >= minimum


def test_kubevbmc_agent_from_the_image_powers_a_vm_for_ipmitool(
        kubevbmc_image: str, sim: Sim, api: Any, namespace: str, tmp_path: Path) -> None:
    make_vm(api, namespace)
    # The agent reads the kubeconfig as its user (65532): a copy it may read, mounted read-only.
    kubeconfig = tmp_path / "kubeconfig"
    shutil.copy(sim.kubeconfig, kubeconfig)
    kubeconfig.chmod(0o644)
    ipmi, http = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_STREAM)
    name = f"agent-{namespace}"
    command = podman().argv(
        "run", "--rm", "--name", name, "--network", "host", "--read-only", "--read-only-tmpfs=false",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges", *podman().limits,
        "--mount", f"type=bind,source={kubeconfig},destination=/etc/kubevbmc/kubeconfig,ro=true",
        "--env", f"VBMC_USERNAME={USER}", "--env", f"VBMC_PASSWORD={PASSWORD}",
        kubevbmc_image, "agent", "--kubeconfig", "/etc/kubevbmc/kubeconfig", "--namespace", namespace, "--vm", "vm",
        "--ipmi-address", f"127.0.0.1:{ipmi}", "--redfish-address", f"127.0.0.1:{http}")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def ready() -> bool:
            assert proc.poll() is None, "the agent container exited"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/readyz", timeout=1) as resp:
                    return bool(resp.status == 200)
            except OSError:
                return False

        wait_for(ready, timeout=60, what="the agent container's /readyz")
        on = ipmitool_at("127.0.0.1", ipmi, "power", "on")
        assert on.returncode == 0 and "Up/On" in on.stdout, on.stderr
        wait_for(lambda: printable(api, namespace) == "Running", timeout=20, what="the VM to run")
        status = ipmitool_at("127.0.0.1", ipmi, "power", "status")
        assert "Chassis Power is on" in status.stdout, status.stderr
        # The CRI's stop: SIGTERM to the container's process; the agent stops its servers at once.
        assert podman().kill(name, signal.SIGTERM)
        assert proc.wait(timeout=STOP_DEADLINE) == 0
    finally:
        if proc.poll() is None:
            podman().remove(name)
            proc.wait(timeout=30)
        output = proc.communicate()[0]
    assert "Traceback" not in output, output
