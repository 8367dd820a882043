#!/usr/bin/env python3
"""Before a release (.github/workflows/release.yml): the tag must be v<the package's version>, the chart's version
and appVersion that version, and the chart's default images (controller and agents) the image the workflow pushes.
Prints what the workflow needs as `key=value` lines (GitHub's step outputs): version, chart_version and
source_date_epoch (the tagged commit's time). Exits 1 with the reason when something disagrees."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "kubevbmc"


def problems(tag: str, image: str, version: str, chart: dict[str, Any], values: dict[str, Any]) -> list[str]:
    """What keeps this tag from being released (empty: nothing)."""
    found = []
    if tag != f"v{version}":
        found.append(f"the tag {tag} is not v{version}, the version in pyproject.toml")
    for field in ("version", "appVersion"):  # one version for the package, the image and the chart
        if chart.get(field) != version:
            found.append(f"charts/kubevbmc/Chart.yaml has {field} {chart.get(field)!r}, not {version!r}")
    for key, settings in (("image", values.get("image")), ("agent.image", (values.get("agent") or {}).get("image"))):
        repository = settings.get("repository") if isinstance(settings, dict) else None
        tag_value = settings.get("tag") if isinstance(settings, dict) else None
        if repository != image:
            found.append(f"values.yaml {key}.repository is {repository!r}, not the released image {image!r}")
        if tag_value:
            found.append(f"values.yaml {key}.tag is {tag_value!r}: leave it empty, so that it is the appVersion")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tag", help="the tag being released, e.g. v0.1.0")
    parser.add_argument("--image", required=True, help="the image repository the workflow pushes")
    args = parser.parse_args(argv)
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    found = problems(args.tag, args.image, version, chart, values)
    if found:
        for problem in found:
            print(f"release_check: {problem}", file=sys.stderr)
        return 1
    epoch = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%ct"], capture_output=True, text=True,
                           check=True).stdout.strip()
    print(f"version={version}\nchart_version={chart['version']}\nsource_date_epoch={epoch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
