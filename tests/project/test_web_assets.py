"""The page's files: third-party code vendored from npm as scripts/vendor-web.py recorded it (pinned versions,
unchanged files, each package's licence beside it), and nothing the page loads from anywhere but the agent."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from vbmc.web import assets

STATIC = Path(__file__).resolve().parents[2] / "vbmc" / "web" / "static"
VENDOR = STATIC / "vendor"


def manifest() -> list[dict[str, object]]:
    return list(json.loads((VENDOR / "vendor.json").read_text()))


def test_every_vendored_file_is_the_pinned_packages_own() -> None:
    packages = manifest()
    assert {(p["package"], p["version"]) for p in packages} == {
        ("@xterm/xterm", "6.0.0"), ("@xterm/addon-fit", "0.11.0"), ("@novnc/novnc", "1.7.0")}
    listed = set()
    for package in packages:
        directory = VENDOR / str(package["directory"])
        files = package["files"]
        assert isinstance(files, dict)
        assert "LICENSE.txt" in files, f"{package['package']} has no licence beside it"
        for name, digest in files.items():
            path = directory / name
            assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, f"{path} changed since it was vendored"
            listed.add(path)
        assert str(package["integrity"]).startswith("sha512-")
    on_disk = {p for p in VENDOR.rglob("*") if p.is_file() and p.name != "vendor.json"}
    assert on_disk == listed, on_disk ^ listed


def test_the_page_loads_nothing_from_elsewhere() -> None:
    for path in STATIC.glob("*.*"):
        text = path.read_text()
        assert not re.search(r"""(src|href)\s*=\s*["'](https?:)?//""", text), path
        assert not re.search(r"""import\s[^;]*from\s*["']https?:""", text), path
        assert not re.search(r"<script>|<style>|\sstyle=|\son[a-z]+=", text), f"inline script or style in {path}"
    code = "".join(line for p in STATIC.glob("*.js") for line in p.read_text().splitlines()
                   if not line.lstrip().startswith("//"))
    assert not re.search(r"localStorage|sessionStorage|document\.cookie|indexedDB", code)  # the token: memory only


def test_every_asset_the_page_names_is_served() -> None:
    page = (STATIC / "index.html").read_text()
    scripts = "".join(p.read_text() for p in STATIC.glob("*.js"))
    named = set(re.findall(r"""["'](/ui/[^"']+)["']""", page + scripts))
    assert named >= {"/ui/app.js", "/ui/app.css", "/ui/vendor/xterm/xterm.mjs", "/ui/vendor/novnc/core/rfb.js"}
    for path in named:
        assert assets.find(path) is not None, path
    assert assets.find("/ui/../assets.py") is None and assets.find("/ui/vendor/vendor.json") is not None
    status, headers, _ = assets.answer("/", [], https_only=False)
    csp = dict(headers)[b"content-security-policy"].decode()
    assert status == 200 and "script-src 'self';" in csp and "'unsafe-eval'" not in csp
    assert assets.answer("/", [], https_only=True)[0] == 403  # no login form where credentials may not go
