"""The documentation stays true: its links resolve, and what docs/reference.md lists (condition reasons, Events,
flags, IPMI commands, Redfish routes) is what the code does; every manifest in the docs is accepted by the CRD it
is written for, and every example status is what the controller would write."""

from __future__ import annotations

import argparse
import ast
import base64
import copy
import itertools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import yaml

from controller import cli as controller_cli
from controller import desired, rollout, status
from controller.reconciler import Reconciler
from controller.spec import BMCSpec
from kubesim import cel
from kubesim import cli as sim_cli
from kubesim.schema import apply_defaults
from vbmc import demo as demo_cli
from vbmc.agent import command as agent_cli
from vbmc.ipmi import codec
from vbmc.ipmi.server import IpmiServer
from vbmc.machine import ResetType
from vbmc.machine.memory import MemoryMachine
from vbmc.redfish import errors
from vbmc.redfish.app import create_app

from ..support.cluster import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
REFERENCE = REPO / "docs" / "reference.md"
CRD_FILE = REPO / "controller" / "crds" / "bmc.kubevirt.io_virtualmachinebmcs.yaml"
VM_CRD_FILE = REPO / "kubesim" / "crds" / "kubevirt.io_virtualmachines.yaml"


def doc_id(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


# ---- reading Markdown

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class CodeBlock:
    path: Path
    lang: str
    body: str


def code_blocks(path: Path) -> list[CodeBlock]:
    blocks = []
    for m in FENCE.finditer(path.read_text()):
        indent = len(m.group("indent"))
        body = "\n".join(line[indent:] for line in m.group("body").splitlines())
        blocks.append(CodeBlock(path, m.group("lang"), body))
    return blocks


def prose(path: Path) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", path.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(path).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def section(path: Path, heading: str) -> str:
    """The text under `heading` (any level) up to the next heading of the same or a higher level."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*$", line)
        if m and m.group(2) == heading:
            level = len(m.group(1))
            body = []
            for following in lines[i + 1:]:
                n = re.match(r"^(#{1,6})\s", following)
                if n and len(n.group(1)) <= level:
                    break
                body.append(following)
            return "\n".join(body)
    raise AssertionError(f"{doc_id(path)} has no heading {heading!r}")


def split_row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().replace("\\|", "|") for c in cells]


def tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table in `text`, as rows keyed by the header's cells."""
    found: list[list[dict[str, str]]] = []
    rows: list[dict[str, str]] = []
    header: list[str] | None = None
    for line in [*text.splitlines(), ""]:
        if line.lstrip().startswith("|"):
            cells = split_row(line)
            if header is None:
                header = cells
            elif all(re.fullmatch(r":?-+:?", c) for c in cells):
                continue
            else:
                rows.append(dict(zip(header, cells, strict=False)))
        elif header is not None:
            found.append(rows)
            rows, header = [], None
    return found


def table(path: Path, heading: str) -> list[dict[str, str]]:
    [only] = [t for t in tables(section(path, heading)) if t] or [[]]
    assert only, f"no table under {heading!r} in {doc_id(path)}"
    return only


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def first_ticked(cell: str) -> str | None:
    found = ticked(cell)
    return found[0] if found and cell.startswith("`") else None


# ---- links


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_every_relative_link_resolves(path: Path) -> None:
    broken = []
    for target in LINK.findall(prose(path)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # http(s), mailto: not ours to check
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading with that anchor")
    assert broken == []


def test_the_readme_links_every_page_in_docs() -> None:
    linked = {(REPO / t.partition("#")[0]).resolve() for t in LINK.findall(prose(REPO / "README.md"))
              if not re.match(r"^[a-z][a-z0-9+.-]*:", t)}
    assert {p.resolve() for p in (REPO / "docs").glob("*.md")} <= linked


# ---- condition types, reasons and Events: from the code


def python_files(*packages: str) -> list[Path]:
    return [p for package in packages for p in sorted((REPO / package).rglob("*.py"))]


def reasons_in_code() -> set[str]:
    """Every reason literal the controller can put in a condition: the third argument of `Condition(...)`, and the
    reason of every (reason, message) or (ok, reason, message) tuple a function annotated to return a tuple gives."""
    found = set()
    for path in python_files("controller"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Condition"
                    and len(node.args) >= 3 and isinstance(node.args[2], ast.Constant)):
                found.add(str(node.args[2].value))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None \
                    and "tuple" in ast.unparse(node.returns):
                for ret in ast.walk(node):
                    if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Tuple):
                        for elt in ret.value.elts:
                            if isinstance(elt, ast.Constant) and isinstance(elt.value, str) and re.fullmatch(
                                    r"[A-Z][A-Za-z]+", elt.value):
                                found.add(elt.value)
    return found


def events_in_code() -> set[str]:
    """Event reasons: `recorder.event(obj, type, "Reason", message)` in the controller and
    `self._event("Reason", message)` or `machine.record_event("Reason", message, type)` in the agent."""
    found = set()
    trees = [ast.parse(path.read_text()) for path in python_files("controller", "vbmc")]
    # A reason may be a module constant (MANAGER_RESET = "ManagerReset", shared with the frontend that hears it).
    constants = {t.id: n.value.value for tree in trees for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}
    for tree in trees:
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            position = {"event": 2, "_event": 0, "record_event": 0}.get(node.func.attr)
            reason = node.args[position] if position is not None and len(node.args) > position else None
            if isinstance(reason, ast.Constant) and isinstance(reason.value, str):
                found.add(reason.value)
            elif isinstance(reason, ast.Name) and reason.id in constants:
                found.add(constants[reason.id])
    return found


def documented_reasons() -> dict[str, tuple[set[str], str]]:
    rows = table(REFERENCE, "Condition reasons")
    out = {}
    for row in rows:
        reason = first_ticked(row["Reason"])
        assert reason, row
        assert reason not in out, f"{reason} is listed twice"
        out[reason] = (set(ticked(row["Conditions"])), row["Status"])
    return out


def test_the_condition_types_are_the_controllers() -> None:
    documented = [first_ticked(row["Condition"]) for row in table(REFERENCE, "Conditions")]
    assert documented == list(status.CONDITION_ORDER)


def test_every_reason_the_code_sets_is_documented_and_nothing_else() -> None:
    in_code = reasons_in_code()
    assert {"Ready", "Conflict", "SecretNotFound", "TLSSecretInvalid", "AgentProgressing"} <= in_code
    assert set(documented_reasons()) == in_code


def observed_worlds() -> Iterator[status.Observed]:
    """Every combination of what a reconcile can observe, with the problems the code itself reports."""
    spec_without_ref = BMCSpec.of({"spec": {"virtualMachineRef": {"name": "vm"}}})
    spec = BMCSpec.of({"spec": {"virtualMachineRef": {"name": "vm"}, "authSecretRef": {"name": "auth"}}})
    credentials = [None, desired.credentials_problem(spec_without_ref, None),
                   desired.credentials_problem(spec, None),
                   desired.credentials_problem(spec, {"data": {"username": "YQ=="}})]
    tls_secrets = {"ok": {"data": {"tls.crt": base64.b64encode(b"c").decode(),
                                   "tls.key": base64.b64encode(b"k").decode()}},
                   "empty": {"data": {}}}
    fake = SimpleNamespace(caches=SimpleNamespace(secrets=SimpleNamespace(get=lambda ns, name: tls_secrets.get(name))))
    tls = [None, *(Reconciler._tls_problem(fake, "ns", name) for name in ("missing", "empty", "ok"))]  # type: ignore[arg-type]

    def deployment(generation: int, observed: int, updated: int, ready: int, replicas: int) -> dict[str, Any]:
        return {"metadata": {"generation": generation}, "spec": {"replicas": 1},
                "status": {"observedGeneration": observed, "updatedReplicas": updated, "readyReplicas": ready,
                           "replicas": replicas}}

    deployments = [None, deployment(2, 1, 1, 1, 1), deployment(2, 2, 0, 0, 1), deployment(2, 2, 1, 1, 2),
                   deployment(2, 2, 1, 0, 1), deployment(2, 2, 1, 1, 1)]
    for vm, cred, tls_problem, conflict, blocked, rejected, ip, dep in itertools.product(
            (True, False), credentials, tls, ("", "older"), ("", "Service vm-virtbmc is controlled by another"),
            ("", "the API server refused Service vm-virtbmc: 422 Invalid: ..."), ("", "10.0.0.1"), deployments):
        yield status.Observed(vm_found=vm, credentials_problem=cred, tls_problem=tls_problem, conflict_with=conflict,
                              blocked_by=blocked, rejected=rejected, cluster_ip=ip, deployment=dep)
    # Pools and the fleet's rollout (controller/rollout.py): an agent past its progress deadline, a pool without a
    # free place, and each AgentUpToDate state of a BMC with an agent.
    failed = deployment(2, 2, 1, 0, 1)
    failed["status"]["conditions"] = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                                       "message": 'ReplicaSet "vm-virtbmc-1" has timed out progressing.'}]
    plan = rollout.Plan(target="abc", image="kubevbmc:v2", total=3, outdated=(("ns", "a"), ("ns", "b")),
                        allowed=frozenset({("ns", "a")}))
    halted = rollout.Plan(target="abc", image="kubevbmc:v2", total=3, outdated=(("ns", "a"),),
                          allowed=frozenset(), halted_by=("ns", "c"), halted_why="timed out")
    states = [plan.state(("ns", "a")), plan.state(("ns", "b")), halted.state(("ns", "a"))]
    for pool, dep, up in itertools.product(("", "lab"), (failed, deployments[-1]), states):
        yield status.Observed(vm_found=True, credentials_problem=None, cluster_ip="10.0.0.1", deployment=dep,
                              pool=pool, up_to_date=up)
    yield status.Observed(vm_found=True, credentials_problem=None, pool="lab", pool_full=True)
    # A pool member its agent reports unable to serve (status.agent).
    yield status.Observed(vm_found=True, credentials_problem=None, cluster_ip="10.0.0.1", deployment=deployments[-1],
                          pool="lab", not_serving="HTTPS: 127.0.0.1:40003: certificate does not load")


def test_the_documented_conditions_and_status_of_each_reason_are_what_the_controller_produces() -> None:
    spec = BMCSpec.of({"spec": {"virtualMachineRef": {"name": "vm"}, "authSecretRef": {"name": "auth"}}})
    produced: dict[str, tuple[set[str], set[str]]] = {}
    for world in observed_worlds():
        for cond in status.conditions_of(spec, world, "vm"):
            types, statuses = produced.setdefault(cond.reason, (set(), set()))
            types.add(cond.type)
            statuses.add(str(cond.status))
    assert set(produced) == reasons_in_code(), "the enumeration reaches every reason the code names"
    documented = {reason: (types, {status_}) for reason, (types, status_) in documented_reasons().items()}
    assert documented == produced


def test_every_event_reason_is_documented_and_nothing_else() -> None:
    rows = table(REFERENCE, "Events")
    documented = {r for r in (first_ticked(row["Reason"]) for row in rows) if r}
    in_code = events_in_code()
    assert {"Created", "RunStrategyManual", "BootOverrideConsumed"} <= in_code
    assert documented == in_code


# ---- flags


def parser_of(add_arguments: Callable[[argparse.ArgumentParser], None],
              monkeypatch: pytest.MonkeyPatch, env_names: set[str]) -> argparse.ArgumentParser:
    for name in env_names:
        monkeypatch.delenv(name, raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def env_of_flags(path: Path) -> dict[str, str]:
    """flag -> the environment variable its default reads (`default=env("NAME", ...)`)."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flag = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            for kw in node.keywords:
                if kw.arg == "default":
                    for call in ast.walk(kw.value):
                        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "env":
                            found[str(flag)] = call.args[0].value  # type: ignore[attr-defined]
    return found


@pytest.mark.parametrize(("heading", "add_arguments", "source"), [
    ("Controller flags", controller_cli.add_arguments, REPO / "controller" / "settings.py"),
    ("Agent flags", agent_cli.add_arguments, REPO / "vbmc" / "agent" / "command.py"),
])
def test_the_flag_tables_are_the_parsers(heading: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                                         source: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    envs = env_of_flags(source)
    parser = parser_of(add_arguments, monkeypatch, set(envs.values()) | {"KUBECONFIG"})
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings[0] != "-h"}
    rows = {first_ticked(row["Flag"]): row for row in table(REFERENCE, heading)}
    assert set(rows) == set(actions)
    for flag, row in rows.items():
        assert (first_ticked(row["Environment variable"]) or None) == envs.get(str(flag)), flag
        default = actions[str(flag)].default
        shown = first_ticked(row["Default"])
        if shown is None:
            assert default in ("", None), f"{flag}: the table shows no default value, the parser has {default!r}"
        else:
            assert shown == str(default), f"{flag}: the table says {shown}, the parser {default!r}"


SUBCOMMANDS = {"agent": agent_cli.add_arguments, "controller": controller_cli.add_arguments,
               "sim": sim_cli.add_arguments, "demo": demo_cli.add_arguments}


def kubevbmc_invocations() -> Iterator[tuple[Path, str, list[str]]]:
    for path in DOCS:
        texts = [b.body for b in code_blocks(path)] + re.findall(r"`([^`\n]+)`", prose(path))
        for text in texts:
            joined = re.sub(r"\\\n\s*", " ", text)
            for m in re.finditer(r"kubevbmc (agent|controller|sim|demo)\b([^\n|;&]*)", joined):
                yield path, m.group(1), m.group(2).split()


def test_every_kubevbmc_command_in_the_docs_uses_existing_flags() -> None:
    unknown = []
    for path, command, words in kubevbmc_invocations():
        parser = argparse.ArgumentParser()
        SUBCOMMANDS[command](parser)
        options = {s for a in parser._actions for s in a.option_strings}
        for word in words:
            flag = word.strip("[]").split("=")[0]
            if flag.startswith("--") and flag not in options:
                unknown.append(f"{doc_id(path)}: kubevbmc {command} {flag}")
    assert unknown == []


# ---- IPMI and Redfish tables


def test_the_ipmi_table_lists_exactly_the_commands_the_bmc_answers() -> None:
    server = IpmiServer(MemoryMachine("vm"), "admin", "password")
    answered = set(server._commands) | {(codec.NETFN_APP, codec.SET_SESSION_PRIVILEGE_LEVEL),
                                        (codec.NETFN_APP, codec.CLOSE_SESSION)}
    rows = table(REFERENCE, "IPMI commands")
    documented = [(int(row["NetFn"].split()[0], 16), int(row["Cmd"], 16)) for row in rows]
    assert len(documented) == len(set(documented))
    assert set(documented) == answered


def normalise(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path)


def test_the_redfish_table_lists_exactly_the_routes_and_methods_the_service_has() -> None:
    app = create_app(MemoryMachine("SYSTEMID"), "admin", "password", system_id="SYSTEMID")
    served: dict[str, set[str]] = {}
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue  # Flask's default static route; no files behind it
        path = normalise(re.sub(r"<(?:\w+:)?\w+>", "{}", rule.rule).replace("SYSTEMID", "{}"))
        served.setdefault(path, set()).update(set(rule.methods or ()) - {"HEAD", "OPTIONS"})
    documented = {normalise(first_ticked(row["Path"]) or ""): {m.strip() for m in row["Methods"].split(",")}
                  for row in table(REFERENCE, "Redfish resources and actions")}
    assert documented == served


def test_the_power_table_covers_every_reset_type() -> None:
    rows = table(REFERENCE, "Power")
    documented = [t for row in rows for t in ticked(row["Redfish ResetType"])]
    assert sorted(documented) == sorted(r.value for r in ResetType)
    ipmi = [t for row in rows for t in re.findall(r"`power (\w+)`", row["IPMI (ipmitool)"])]
    assert sorted(ipmi) == sorted(["on", "off", "soft", "cycle", "reset", "diag"])


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_redfish_message_ids_in_the_docs_exist(path: Path) -> None:
    for registry, key in re.findall(r"\b(Base\.\d+\.\d+)\.(\w+)", path.read_text()):
        assert registry == errors.REGISTRY and key in errors.MESSAGES, f"{registry}.{key}"


def string_patterns() -> list[tuple[re.Pattern[str], int]]:
    """Every string the controller and agent code can build, as a pattern (an interpolated part matches anything),
    with the number of its literal characters."""
    def pattern(node: ast.AST) -> tuple[str, int]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return re.escape(node.value), len(node.value)
        if isinstance(node, ast.JoinedStr):
            parts = [pattern(v) for v in node.values]
            return "".join(p for p, _ in parts), sum(n for _, n in parts)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            (left, m), (right, n) = pattern(node.left), pattern(node.right)
            return left + right, m + n
        return ".+?", 0

    found: dict[str, int] = {}
    for path in python_files("controller", "vbmc"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant | ast.JoinedStr) or (
                    isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)):
                text, literal = pattern(node)
                if literal:
                    found[text] = literal
    return [(re.compile(p, re.DOTALL), n) for p, n in found.items()]


def said_by_the_code(quote: str, patterns: list[tuple[re.Pattern[str], int]]) -> bool:
    """The quote is a string the code builds, its `<...>` placeholders standing for the interpolated parts: the
    pattern must match it and its own words must make up (nearly) all of the quote's other words."""
    words = len(re.sub(r"<[^>]*>", "", quote))
    return any(p.fullmatch(quote) and literal >= 0.9 * words for p, literal in patterns)


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_quoted_messages_are_the_codes(path: Path) -> None:
    """Cells of a table column named `Message` quote what the agent or controller says, word for word."""
    patterns = string_patterns()
    quoted = [text for rows in tables(prose(path)) for row in rows for key, cell in row.items()
              if key == "Message" for text in ticked(cell)]
    assert [q for q in quoted if not said_by_the_code(q, patterns)] == []


# ---- YAML blocks and the manifests in them


def yaml_documents() -> Iterator[tuple[Path, int, Any]]:
    for path in DOCS:
        for index, block in enumerate(b for b in code_blocks(path) if b.lang in ("yaml", "yml")):
            for doc in yaml.safe_load_all(block.body):
                if doc is not None:
                    yield path, index, doc


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_every_yaml_block_parses(path: Path) -> None:
    for block in code_blocks(path):
        if block.lang in ("yaml", "yml"):
            list(yaml.safe_load_all(block.body))


def structural(schema: dict[str, Any], root: bool = False) -> dict[str, Any]:
    """A CRD's openAPIV3Schema as JSON Schema that, like kube-apiserver with fieldValidation=Strict (kubectl's
    default), refuses fields the schema does not declare."""
    out: dict[str, Any] = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if schema.get("nullable") and "type" in schema:
        out["type"] = [schema["type"], "null"]
    preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
    if "properties" in schema:
        out["properties"] = {k: structural(v) for k, v in schema["properties"].items()}
        if root:
            for meta in ("apiVersion", "kind", "metadata"):
                out["properties"].setdefault(meta, {})
        if "additionalProperties" not in schema and not preserve:
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        out["items"] = structural(schema["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            out[key] = [structural(s) for s in schema[key]]
    return out


def cel_violations(schema: dict[str, Any], value: Any) -> list[str]:
    """The CRD's CEL rules that a new object breaks, evaluated as kubesim evaluates them on a create."""
    validator = cel.rule_validator(schema)
    return [f"{c.get('field')}: {c.get('message')}" for c in validator(value, None)] if validator else []


def crd_schema(path: Path) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    [version] = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return dict(version["schema"]["openAPIV3Schema"])


def admitted(doc: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    problems = [f"{'.'.join(map(str, e.absolute_path)) or '.'}: {e.message}"
                for e in jsonschema.Draft7Validator(structural(schema, root=True)).iter_errors(doc)]
    return problems + cel_violations(schema, apply_defaults(schema, copy.deepcopy(doc)))


def manifests(kind: str) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{doc_id(path)} block {index}", doc) for path, index, doc in yaml_documents()
            if isinstance(doc, dict) and doc.get("kind") == kind]


def test_the_crd_validation_used_here_refuses_what_the_api_server_refuses() -> None:
    schema = crd_schema(CRD_FILE)
    good: dict[str, Any] = {
        "apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC", "metadata": {"name": "a"},
        "spec": {"virtualMachineRef": {"name": "vm"}, "authSecretRef": {"name": "s"}}}
    assert admitted(good, schema) == []
    unknown = copy.deepcopy(good)
    unknown["spec"]["service"] = {"labels": {"a": "b"}}
    assert admitted(unknown, schema)
    neither = copy.deepcopy(good)
    neither["spec"].update(ipmi={"enabled": False}, redfish={"enabled": False})
    assert admitted(neither, schema) == [
        'spec: Invalid value: "object": at least one of ipmi and redfish must be enabled']
    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["service"] = {"type": "ExternalName"}
    assert admitted(wrong_type, schema)


def test_every_virtualmachinebmc_in_the_docs_is_accepted_by_the_crd() -> None:
    found = manifests("VirtualMachineBMC")
    assert len(found) >= 5
    schema = crd_schema(CRD_FILE)
    for where, doc in found:
        assert doc.get("apiVersion") == "bmc.kubevirt.io/v1beta1", where
        assert admitted(doc, schema) == [], where


def test_every_example_status_is_what_the_controller_writes() -> None:
    with_status = [(where, doc) for where, doc in manifests("VirtualMachineBMC") if doc.get("status")]
    assert with_status, "the quickstart shows a status"
    for where, doc in with_status:
        spec = BMCSpec.of(doc)
        got = doc["status"]
        assert got.get("endpoints") == status.endpoints(spec, got["clusterIP"], spec.virtual_machine_ref.name), where
        types = [c["type"] for c in got.get("conditions") or []]
        assert types == list(status.CONDITION_ORDER), where
        assert {c["reason"] for c in got["conditions"]} <= reasons_in_code(), where


def test_every_virtualmachine_in_the_docs_is_accepted_by_kubevirts_crd() -> None:
    found = manifests("VirtualMachine")
    assert found
    schema = crd_schema(VM_CRD_FILE)
    for where, doc in found:
        assert doc.get("apiVersion") == "kubevirt.io/v1", where
        assert admitted(doc, schema) == [], where


def test_every_credentials_secret_in_the_docs_has_username_and_password() -> None:
    referenced = {doc["spec"]["authSecretRef"]["name"] for _, doc in manifests("VirtualMachineBMC")
                  if doc["spec"].get("authSecretRef")}
    referenced |= {doc["spec"]["bmc"]["credentialsName"] for _, doc in manifests("BareMetalHost")}
    secrets = [(where, doc) for where, doc in manifests("Secret") if doc["metadata"]["name"] in referenced]
    assert secrets
    for where, doc in secrets:
        keys = set(doc.get("stringData") or {}) | set(doc.get("data") or {})
        assert {"username", "password"} <= keys, where


def address_form(example: str) -> re.Pattern[str]:
    """An endpoint the status gives, with any host and port (outside the cluster they are the Service's
    external ones) and any VM name."""
    scheme, _, rest = example.partition("://")
    _, slash, path = rest.partition("/")
    tail = re.escape(slash + path).replace("VMNAME", r"[a-z0-9.-]+") if slash else ""
    return re.compile(re.escape(scheme) + r"://[^/:]+(?::\d+)?" + tail)


def test_every_baremetalhost_uses_an_address_form_the_status_gives() -> None:
    found = manifests("BareMetalHost")
    spec = BMCSpec.of({"spec": {"virtualMachineRef": {"name": "VMNAME"}}})
    given = status.endpoints(spec, "10.0.0.1", "VMNAME")
    forms = [address_form(given[key]) for key in ("metal3IPMI", "metal3Redfish")]
    schemes = set()
    for where, doc in found:
        bmc = doc["spec"]["bmc"]
        assert any(f.fullmatch(bmc["address"]) for f in forms), (where, bmc["address"])
        schemes.add(bmc["address"].split("://")[0])
        if bmc["address"].startswith("redfish"):
            assert bmc.get("disableCertificateVerification") is True, where
    assert schemes == {"ipmi", "redfish-virtualmedia+https"}
