"""One version, and docs that promise only what exists.

The package (pyproject.toml), the chart's version and appVersion and the Dockerfile's default VERSION are one version,
the one a tag vX.Y.Z releases (scripts/release_check.py refuses a tag that disagrees); every version and image tag
the README and docs/ show is that one (or `dev`, or a placeholder such as `<new>` or `X.Y.Z`), and every chart
version they name is this chart's or the one in the repository's history that the upgrade notes are about.

While the repository has no tag, no release has been made, so nothing is in a registry: the pages that name the
registry (ghcr.io) say plainly that no release has been made, before or where they first name it; every paragraph,
list item, table row or code block (with the paragraph that introduces it) naming ghcr.io speaks of a release, and
one with an `oci://` address of a tagged release; no sentence claims a published chart or image; and the first
`helm install` of the README, the quickstart and the installation page installs the chart from the clone
(`./charts/kubevbmc`) with the four image values, naming an image the page built and pushed before it. Each check
is a function of a text, shown to fail on a bad one at the end of this file.
"""

from __future__ import annotations

import ast
import re
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..support.cluster import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The pages a newcomer installs from: their first `helm install` must work from a clone today.
FIRST_INSTALL = [REPO / "README.md", REPO / "docs" / "quickstart.md", REPO / "docs" / "install.md"]
CHART_DIR = REPO / "charts" / "kubevbmc"
VERSION: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
CHART: dict[str, Any] = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
VALUES: dict[str, Any] = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
IMAGE_VALUES = ("image.repository", "image.tag", "agent.image.repository", "agent.image.tag")


def doc_id(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def previous_chart() -> tuple[str, str]:
    """tests/project/test_helm.py's PREVIOUS_CHART (version, commit): the chart the upgrade notes start from. Read
    from its source, since importing that module loads Helm's SDK."""
    tree = ast.parse((REPO / "tests" / "project" / "test_helm.py").read_text())
    [value] = [node.value for node in tree.body if isinstance(node, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "PREVIOUS_CHART" for t in node.targets)]
    version, commit = ast.literal_eval(value)
    return str(version), str(commit)


def released() -> bool:
    """Whether a release may exist: the repository has a tag vX.Y.Z (what .github/workflows/release.yml runs on). No
    git, or no history: no tag."""
    try:
        tags = subprocess.run(["git", "-C", str(REPO), "tag", "--list", "v*"], capture_output=True, text=True,
                              timeout=30)
    except OSError:
        return False
    return tags.returncode == 0 and bool(tags.stdout.split())


# ---- versions


PLACEHOLDER = re.compile(r"<[^>]*>|X\.Y\.Z")
TAG = r"[\w<>-]+(?:\.[\w<>-]+)*"  # a tag, without a full stop that ends the sentence


def joined(text: str) -> str:
    """The text with shell line continuations joined, so that a command is one line."""
    return re.sub(r"\\\n[ \t]*", " ", text)


def version_problems(text: str, version: str, chart_version: str, earlier_charts: tuple[str, ...] = ()) -> list[str]:
    """Every version or image tag in `text` that is not the one it must be: image tags (`.../kubevbmc:<tag>`,
    `image.tag=`), `appVersion`s and release tags are the package's `version` (image tags may also be `dev`);
    `helm ... --version`, `charts/kubevbmc:<tag>` and `kubevbmc-<x>.tgz` are the chart's; "chart X.Y.Z" is the
    chart's or one of `earlier_charts`. Placeholders (`<new>`, `X.Y.Z`) stand for any."""
    text = joined(text)
    found = []

    def check(what: str, value: str, allowed: set[str]) -> None:
        if not PLACEHOLDER.fullmatch(value) and value not in allowed:
            found.append(f"{what} {value}: expected {' or '.join(sorted(allowed))}")

    for m in re.finditer(rf"(?<![\w./-])((?:[\w.-]+/)*kubevbmc):({TAG})", text):
        if m[1].endswith("charts/kubevbmc"):
            check(f"the chart {m[1]}:", m[2], {chart_version})
        else:
            check(f"the image {m[1]}:", m[2], {version, "dev"})
    for m in re.finditer(rf"(?<![\w.])((?:agent\.)?image\.tag)=[\"']?({TAG})", text):
        check(m[1], m[2], {version, "dev"})
    for line in text.splitlines():
        if re.search(r"\bhelm\b", line):
            for m in re.finditer(rf"--version[ =]({TAG})", line):
                check("helm --version", m[1], {chart_version})
    for m in re.finditer(rf"\bkubevbmc-({TAG})\.tgz\b", text):
        check("the chart package kubevbmc-", m[1], {chart_version})
    for m in re.finditer(r"\bappVersion\b[`\"':= ]*(\d+\.\d+\.\d+)", text):
        check("appVersion", m[1], {version})
    for m in re.finditer(r"`v(\d+\.\d+\.\d+[\w.-]*)`", text):
        check("the release tag v", m[1], {version})
    for m in re.finditer(r"\b[Cc]hart (\d+\.\d+\.\d+)\b", text):
        check("chart", m[1], {chart_version, *earlier_charts})
    return found


def test_the_package_the_chart_its_app_and_the_dockerfile_have_one_version() -> None:
    dockerfile = re.search(r"^ARG VERSION=(\S+)\s*$", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    assert dockerfile, "the Dockerfile declares no ARG VERSION=<default>"
    assert {"pyproject.toml": VERSION, "Chart.yaml version": str(CHART["version"]),
            "Chart.yaml appVersion": str(CHART["appVersion"]), "Dockerfile VERSION": dockerfile[1]} == dict.fromkeys(
        ("pyproject.toml", "Chart.yaml version", "Chart.yaml appVersion", "Dockerfile VERSION"), VERSION)
    # The chart's default images are its appVersion (release_check.py refuses a tag otherwise).
    assert VALUES["image"]["tag"] == VALUES["agent"]["image"]["tag"] == ""


def test_the_chart_the_upgrade_notes_start_from_is_in_the_history_and_older() -> None:
    version, commit = previous_chart()
    old = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:charts/kubevbmc/Chart.yaml"],
                         capture_output=True, text=True, timeout=30)
    assert old.returncode == 0, f"{commit} is not in this clone's history (fetch it all): {old.stderr}"
    assert yaml.safe_load(old.stdout)["version"] == version
    assert tuple(map(int, version.split("."))) < tuple(map(int, str(CHART["version"]).split(".")))


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_every_version_and_image_tag_in_the_docs_is_this_one(path: Path) -> None:
    assert version_problems(path.read_text(), VERSION, str(CHART["version"]), (previous_chart()[0],)) == []


# ---- promises


@dataclass(frozen=True)
class Unit:
    """A paragraph, list item, table row, heading or fenced code block of a Markdown text. `context` is what it
    says: its own text, and for a code block also the prose that introduces it."""
    text: str
    context: str
    code: bool


def units(text: str) -> list[Unit]:
    found: list[Unit] = []
    paragraph: list[str] = []
    introduction = ""

    def flush() -> None:
        nonlocal paragraph, introduction
        if paragraph:
            body = "\n".join(paragraph)
            found.append(Unit(body, body, False))
            introduction = body
            paragraph = []

    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^([ \t]*)```", line)
        if fence:
            flush()
            end = i + 1
            while end < len(lines) and not re.match(rf"^{fence[1]}```[ \t]*$", lines[end]):
                end += 1
            body = "\n".join(lines[i + 1:end])
            found.append(Unit(body, f"{introduction}\n{body}", True))
            i = end + 1
            continue
        if not line.strip():
            flush()
        elif line.startswith("#") or line.lstrip().startswith("|"):
            flush()
            paragraph = [line]
            flush()
        elif re.match(r"^[ \t]*(?:[-*+]|\d+\.)[ \t]", line):
            flush()
            paragraph = [line]
        else:
            paragraph.append(line)
        i += 1
    flush()
    return found


NO_RELEASE = re.compile(r"\bno\s+release\s+has\s+been\s+made\b", re.IGNORECASE)
RELEASE = re.compile(r"\brelease", re.IGNORECASE)
TAGGED_RELEASE = re.compile(r"\btagged\s+release", re.IGNORECASE)
# Sentences that present what a release would publish as there to be had.
CLAIMS = [re.compile(p, re.IGNORECASE) for p in (
    r"\b(?:the|its|our)\s+published\b",
    r"\bpublished\s+(?:chart|image|artefact|artifact)s?\b",
    r"\b(?:is|are)\s+(?:now\s+)?published\b",
    r"\binstalls?\s+the\s+(?:signed|released)\b",
)]


def commands(unit: Unit) -> list[str]:
    """The lines of a code block; the code spans of prose (`...`, which may wrap), each as one line."""
    if unit.code:
        return joined(unit.text).splitlines()
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", unit.text)]


def helm_installs(text: str) -> Iterator[tuple[str, str]]:
    """(the `helm install` command, what the page's code says before it), in order."""
    before = ""
    for unit in units(text):
        for line in commands(unit):
            if re.search(r"\bhelm\s+install\s+\S+\s+\S+", line):  # a command (a release and a chart), not its name
                yield line, before
            before += line + "\n"


def first_install_problems(text: str) -> list[str]:
    """The first `helm install` must install the chart from the clone with the four image values, and the page must
    build (or tag) and push that image before it."""
    first = next(helm_installs(text), None)
    if first is None:
        return ["no `helm install`"]
    line, before = first
    found = []
    if not re.search(r"\shelm\s+install\s+\S+\s+\./charts/kubevbmc(?:\s|$)", f" {line}"):
        found.append(f"the first `helm install` does not install ./charts/kubevbmc: {line.strip()}")
    values = dict(re.findall(r"--set[ =]([\w.]+)=(\S+)", line))
    missing = [key for key in IMAGE_VALUES if key not in values]
    if missing:
        found.append(f"the first `helm install` does not set {', '.join(missing)}: {line.strip()}")
        return found
    for prefix in ("image", "agent.image"):
        image = f"{values[prefix + '.repository']}:{values[prefix + '.tag']}"
        escaped = re.escape(image)
        if not re.search(rf"\b(?:docker|podman|buildah)\b[^\n]*\s(?:build|bud|tag)\b[^\n]*\s{escaped}(?:\s|$)", before):
            found.append(f"{image} ({prefix}) is not built or tagged before the first `helm install`")
        if not re.search(rf"\b(?:docker|podman|buildah)\s+push\s+{escaped}(?:\s|$)", before):
            found.append(f"{image} ({prefix}) is not pushed before the first `helm install`")
    return found


def promise_problems(text: str, first_install: bool = False) -> list[str]:
    """What in `text` presents an unreleased chart or image as available (for a repository with no tag)."""
    found = []
    parts = units(text)
    registry = [i for i, unit in enumerate(parts) if "ghcr.io" in unit.text]
    if registry and not any(NO_RELEASE.search(unit.context) for unit in parts[:registry[0] + 1]):
        found.append("names ghcr.io without saying, before or where it first does, that no release has been made")
    for i in registry:
        unit = parts[i]
        if "oci://" in unit.text and not TAGGED_RELEASE.search(unit.context):
            found.append(f"an oci:// address outside of what a tagged release publishes: {unit.text.strip()[:200]}")
        elif not RELEASE.search(unit.context):
            found.append(f"ghcr.io named without a word of a release: {unit.text.strip()[:200]}")
    for claim in CLAIMS:
        for m in claim.finditer(re.sub(r"\s+", " ", text)):
            found.append(f"claims a release exists: {m[0]!r}")
    if first_install:
        found += first_install_problems(text)
    return found


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_no_page_presents_an_unreleased_chart_or_image_as_available(path: Path) -> None:
    if released():
        pytest.skip("the repository has a release tag: a chart and an image may have been published")
    assert promise_problems(path.read_text(), first_install=path in FIRST_INSTALL) == []


def value_paths(values: Any, prefix: str = "") -> set[str]:
    """Every key of values.yaml, dotted as `--set` names it."""
    paths = {prefix} if prefix else set()
    if isinstance(values, dict):
        for key, value in values.items():
            paths |= value_paths(value, f"{prefix}.{key}" if prefix else key)
    return paths


def test_every_helm_set_in_the_docs_names_a_value_of_the_chart() -> None:
    known = value_paths(VALUES)
    assert set(IMAGE_VALUES) <= known
    unknown = []
    for path in DOCS:
        for unit in units(path.read_text()):
            for line in commands(unit):
                if re.search(r"\bhelm\s+(?:install|upgrade|template)\b", line):
                    unknown += [f"{doc_id(path)}: {key}" for key in re.findall(r"--set[ =]([\w.]+)=", line)
                                if key not in known]
    assert unknown == []


# ---- the checks fail on what they are there to catch


GOOD_INSTALL = """No release has been made yet: build, push, install from the clone.

```sh
docker build -t registry.example.com/kubevbmc:1.2.3 .
docker push registry.example.com/kubevbmc:1.2.3
helm install kubevbmc ./charts/kubevbmc --namespace kubevbmc-system --create-namespace \\
    --set image.repository=registry.example.com/kubevbmc --set image.tag=1.2.3 \\
    --set agent.image.repository=registry.example.com/kubevbmc --set agent.image.tag=1.2.3
```

A tagged release is to publish `oci://ghcr.io/kubevbmc/charts/kubevbmc`; none has been made yet.
"""

# What README.md said before: the first command of a newcomer failed.
PUBLISHED_CLAIM = """For a cluster with KubeVirt, `helm install kubevbmc oci://ghcr.io/kubevbmc/charts/kubevbmc
--version 1.2.3 --namespace kubevbmc-system --create-namespace` installs the published chart (signed, as is its
image): the CRD, the controller and its least-privilege RBAC.
"""


@pytest.mark.parametrize(("text", "complaint"), [
    (GOOD_INSTALL, None),
    ("docker build -t registry.example.com/kubevbmc:1.2.3 .", None),
    ("the agent runs revision 3f9c (ghcr.io/kubevbmc/kubevbmc:1.2.2)", "the image ghcr.io/kubevbmc/kubevbmc: 1.2.2"),
    ("docker push registry.example.com/kubevbmc:1.1.0", "the image registry.example.com/kubevbmc: 1.1.0"),
    ("kubevbmc:dev and kubevbmc:<tag> and ghcr.io/kubevbmc/kubevbmc:X.Y.Z", None),
    ("cosign verify ghcr.io/kubevbmc/charts/kubevbmc:1.2.0 \\\n  --certificate-oidc-issuer x",
     "the chart ghcr.io/kubevbmc/charts/kubevbmc: 1.2.0"),
    ("helm upgrade kubevbmc oci://x/kubevbmc \\\n    --version 0.9.0 --reuse-values", "helm --version 0.9.0"),
    ("helm upgrade kubevbmc oci://x/kubevbmc --version <new>", None),
    ("helm install k ./charts/kubevbmc --set agent.image.tag=1.0.0", "agent.image.tag 1.0.0"),
    ("The chart says `appVersion: \"1.2.2\"`.", "appVersion 1.2.2"),
    ("a tagged release `v1.2.4` would publish", "the release tag v 1.2.4"),
    ("**From chart 0.1.0** and to chart 1.2.3", None),
    ("Chart 0.3.0 gives agent pods fsGroup", "chart 0.3.0"),
])
def test_the_version_check_finds_a_version_that_disagrees(text: str, complaint: str | None) -> None:
    found = version_problems(text, "1.2.3", "1.2.3", ("0.1.0",))
    assert found == [] if complaint is None else any(complaint in p for p in found), found


@pytest.mark.parametrize(("text", "first_install", "complaint"), [
    (GOOD_INSTALL, True, None),
    (PUBLISHED_CLAIM, False, "no release has been made"),
    ("No release has been made yet.\n\n" + PUBLISHED_CLAIM, False, "outside of what a tagged release publishes"),
    ("No release has been made.\n\nA tagged release publishes it; `helm install` the published chart.", False,
     "claims a release exists: 'the published'"),
    ("No release has been made.\n\nThe image is published as a multi-arch image.", False,
     "claims a release exists: 'is published'"),
    ("No release has been made yet.\n\n| `image.repository` | `ghcr.io/kubevbmc/kubevbmc` | The image. |", False,
     "ghcr.io named without a word of a release"),
    ("The default `ghcr.io/kubevbmc/kubevbmc` is what a release publishes.\n\nNo release has been made yet.", False,
     "before or where it first does"),
    ("No release has been made yet; a tagged release publishes it:\n\n```sh\n"
     "helm install kubevbmc oci://ghcr.io/kubevbmc/charts/kubevbmc --version 1.2.3\n```", False, None),
    (PUBLISHED_CLAIM, True, "the first `helm install` does not install ./charts/kubevbmc"),
    (GOOD_INSTALL.replace(" --set agent.image.tag=1.2.3", ""), True, "does not set agent.image.tag"),
    (GOOD_INSTALL.replace("docker push registry.example.com/kubevbmc:1.2.3\n", ""), True,
     "registry.example.com/kubevbmc:1.2.3 (image) is not pushed"),
    (GOOD_INSTALL.replace("docker build -t registry.example.com/kubevbmc:1.2.3 .",
                          "docker build -t registry.example.com/kubevbmc:1.2.2 ."), True,
     "registry.example.com/kubevbmc:1.2.3 (agent.image) is not built or tagged"),
    ("No release has been made.", True, "no `helm install`"),
])
def test_the_promise_check_finds_a_claim_of_what_does_not_exist(text: str, first_install: bool,
                                                               complaint: str | None) -> None:
    found = promise_problems(text, first_install=first_install)
    assert found == [] if complaint is None else any(complaint in p for p in found), found


def test_units_keep_a_code_block_with_the_paragraph_that_introduces_it() -> None:
    parts = units("# Title\n\nIntro line one\nand two:\n\n```sh\nrun it\n```\n\n- an item\n  continued\n"
                  "- another\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    assert [(u.text, u.code) for u in parts] == [
        ("# Title", False), ("Intro line one\nand two:", False), ("run it", True),
        ("- an item\n  continued", False), ("- another", False), ("| a | b |", False), ("|---|---|", False),
        ("| 1 | 2 |", False)]
    assert parts[2].context == "Intro line one\nand two:\nrun it"
