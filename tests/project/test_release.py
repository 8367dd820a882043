"""The release workflow (.github/workflows/release.yml), checked offline since it runs only on GitHub: a tag builds
the image for amd64 and arm64 and pushes it where the chart's default points, pushes the chart as an OCI artifact to
the same registry, signs both keyless, attaches the SBOM; every action is pinned to a commit; every shell step
parses; and scripts/release_check.py, which the workflow runs first, refuses a tag that disagrees with the package,
the chart or its default image."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from typing import Any

import pytest
import yaml

from ..support.cluster import REPO

WORKFLOW_FILE = REPO / ".github" / "workflows" / "release.yml"
WORKFLOW: dict[Any, Any] = yaml.safe_load(WORKFLOW_FILE.read_text())
[(JOB_NAME, JOB)] = WORKFLOW["jobs"].items()
STEPS: list[dict[str, Any]] = JOB["steps"]
VALUES = yaml.safe_load((REPO / "charts" / "kubevbmc" / "values.yaml").read_text())
CHART_META = yaml.safe_load((REPO / "charts" / "kubevbmc" / "Chart.yaml").read_text())
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
sys.path.insert(0, str(REPO / "scripts"))
import release_check  # noqa: E402  (a script, not a package)


def step(name_or_action: str) -> dict[str, Any]:
    found = [s for s in STEPS if name_or_action in (s.get("uses", "").split("@")[0], s.get("id"))]
    assert len(found) == 1, f"expected one step {name_or_action}"
    return found[0]


def runs() -> str:
    return "\n".join(s.get("run", "") for s in STEPS)


def test_a_version_tag_runs_it_with_only_the_permissions_it_needs() -> None:
    triggers = WORKFLOW.get("on", WORKFLOW.get(True))  # YAML 1.1 reads a bare `on` as true
    assert triggers == {"push": {"tags": ["v*"]}}
    assert WORKFLOW["permissions"] == {"contents": "read"}
    assert JOB["permissions"] == {"contents": "write", "packages": "write", "id-token": "write"}


def test_every_action_is_pinned_to_a_commit_with_its_version_named() -> None:
    lines = WORKFLOW_FILE.read_text().splitlines()
    used = [s["uses"] for s in STEPS if "uses" in s]
    assert len(used) >= 8
    for uses in used:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", uses), f"{uses}: pin a commit, not a tag"
        [line] = [line for line in lines if f"uses: {uses}" in line]
        assert re.search(r"# v\d+\.\d+\.\d+$", line), f"{line.strip()}: name the version the commit is"


def test_the_image_is_built_for_amd64_and_arm64_and_pushed_where_the_chart_points() -> None:
    image = WORKFLOW["env"]["IMAGE"]
    assert VALUES["image"]["repository"] == VALUES["agent"]["image"]["repository"] == image
    assert VALUES["image"]["tag"] == VALUES["agent"]["image"]["tag"] == ""  # the chart's appVersion
    build = step("docker/build-push-action")["with"]
    assert build["platforms"] == "linux/amd64,linux/arm64" and build["push"] is True
    assert build["tags"] == "${{ env.IMAGE }}:${{ steps.versions.outputs.version }}"
    assert build["sbom"] is True and build["provenance"] == "mode=max"
    args = dict(line.split("=", 1) for line in build["build-args"].splitlines())
    assert args == {"VERSION": "${{ steps.versions.outputs.version }}",
                    "SOURCE_DATE_EPOCH": "${{ steps.versions.outputs.source_date_epoch }}"}
    dockerfile = (REPO / "Dockerfile").read_text()
    for arg in args:
        assert re.search(rf"^ARG {arg}\b", dockerfile, re.MULTILINE), f"the Dockerfile has no ARG {arg}"
    assert step("docker/setup-qemu-action") and step("docker/setup-buildx-action")  # arm64 on an amd64 runner
    login = step("docker/login-action")["with"]
    assert login["registry"] == image.split("/")[0]


def test_the_chart_goes_to_the_same_registry_and_both_are_signed_keyless_with_the_sbom_attached() -> None:
    image, charts = WORKFLOW["env"]["IMAGE"], WORKFLOW["env"]["CHARTS"]
    assert charts == f"oci://{image.split('/')[0]}/{image.split('/')[1]}/charts"
    script = runs()
    assert 'cosign sign --yes "$IMAGE@$DIGEST"' in script
    assert 'cosign attest --yes --type spdxjson --predicate sbom-amd64.spdx.json "$IMAGE@$DIGEST"' in script
    assert "helm package charts/kubevbmc" in script
    assert 'helm push "dist/kubevbmc-$CHART_VERSION.tgz" "$CHARTS"' in script
    assert 'cosign sign --yes "${CHARTS#oci://}/kubevbmc@$digest"' in script
    assert "--key" not in script, "keyless: the signature names the workflow, no key to keep"
    assert 'gh release create "$GITHUB_REF_NAME"' in script and 'kubevbmc-$VERSION.sbom.json' in script
    order = [s.get("id") or s.get("uses", "").split("@")[0] or s["name"] for s in STEPS]
    assert order.index("versions") < order.index("image") < order.index("azure/setup-helm")
    # docs/install.md installs from where the chart goes, at the version the chart has.
    install = (REPO / "docs" / "install.md").read_text()
    assert f"{charts}/kubevbmc --version {CHART_META['version']}" in install


def test_every_shell_step_parses() -> None:
    for s in STEPS:
        if "run" in s:
            assert "${{" not in s["run"], f"{s['name']}: pass expressions through env, not into the script"
            checked = subprocess.run(["bash", "-n", "-c", s["run"]], capture_output=True, text=True)
            assert checked.returncode == 0, f"{s['name']}: {checked.stderr}"


def test_release_check_accepts_this_version_and_says_what_the_workflow_needs() -> None:
    image = WORKFLOW["env"]["IMAGE"]
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "release_check.py"), f"v{VERSION}", "--image",
                           image], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    outputs = dict(line.split("=", 1) for line in done.stdout.splitlines())
    assert outputs["version"] == VERSION and outputs["chart_version"] == CHART_META["version"]
    assert outputs["source_date_epoch"].isdigit()
    refused = subprocess.run([sys.executable, str(REPO / "scripts" / "release_check.py"), "v99.0.0", "--image",
                              image], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1 and f"the tag v99.0.0 is not v{VERSION}" in refused.stderr


IMAGE = "ghcr.io/kubevbmc/kubevbmc"
GOOD_VALUES = {"image": {"repository": IMAGE, "tag": ""}, "agent": {"image": {"repository": IMAGE, "tag": ""}}}


GOOD_CHART = {"version": "1.2.3", "appVersion": "1.2.3"}


@pytest.mark.parametrize(("tag", "chart", "values", "complaint"), [
    ("v1.2.3", GOOD_CHART, GOOD_VALUES, None),
    ("1.2.3", GOOD_CHART, GOOD_VALUES, "the tag 1.2.3 is not v1.2.3"),
    ("v1.2.3", {**GOOD_CHART, "appVersion": "1.2.2"}, GOOD_VALUES, "has appVersion '1.2.2', not '1.2.3'"),
    ("v1.2.3", {**GOOD_CHART, "version": "1.3.0"}, GOOD_VALUES, "has version '1.3.0', not '1.2.3'"),
    ("v1.2.3", GOOD_CHART, {**GOOD_VALUES, "image": {"repository": "quay.io/x/y", "tag": ""}},
     "values.yaml image.repository is 'quay.io/x/y'"),
    ("v1.2.3", GOOD_CHART, {**GOOD_VALUES, "agent": {"image": {"repository": IMAGE, "tag": "dev"}}},
     "values.yaml agent.image.tag is 'dev'"),
])
def test_release_check_refuses_a_tag_that_disagrees(tag: str, chart: dict[str, Any], values: dict[str, Any],
                                                    complaint: str | None) -> None:
    found = release_check.problems(tag, IMAGE, "1.2.3", chart, values)
    assert found == [] if complaint is None else any(complaint in p for p in found), found
