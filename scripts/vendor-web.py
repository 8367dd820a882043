#!/usr/bin/env python3
"""Vendor the page's third-party code (vbmc/web/static/vendor/) from npm, pinned, with its licences.

The page must work with no network but the agent's (no CDN), so xterm.js (the serial terminal) and noVNC (the
screen) are served by the agent. This script is how they got there and how to update them: it `npm pack`s each
package at the version below, checks the tarball against the integrity npm records for it, copies the files the
page uses (unchanged) and the licence, and writes vbmc/web/static/vendor/vendor.json (package, version, integrity,
licence, and a sha256 per file), which tests/project/test_web_assets.py checks the files against.

Run it from the repository's root: `python3 scripts/vendor-web.py` (needs npm and the npm registry).
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "vbmc" / "web" / "static" / "vendor"

# name, version, npm's dist.integrity, licence, where it goes, and the files taken (globs under package/).
PACKAGES = [
    ("@xterm/xterm", "6.0.0",
     "sha512-TQwDdQGtwwDt+2cgKDLn0IRaSxYu1tSUjgKarSDkUM0ZNiSRXFpjxEsvc/Zgc5kq5omJ+V0a8/kIM2WD3sMOYg==",
     "MIT", "xterm", {"lib/xterm.mjs": "xterm.mjs", "css/xterm.css": "xterm.css", "LICENSE": "LICENSE.txt"}),
    ("@xterm/addon-fit", "0.11.0",
     "sha512-jYcgT6xtVYhnhgxh3QgYDnnNMYTcf8ElbxxFzX0IZo+vabQqSPAjC3c1wJrKB5E19VwQei89QCiZZP86DCPF7g==",
     "MIT", "xterm-addon-fit", {"lib/addon-fit.mjs": "addon-fit.mjs", "LICENSE": "LICENSE.txt"}),
    ("@novnc/novnc", "1.7.0",
     "sha512-ucEJOx4T2avIRCleodk7YobZj5O2Ga2AeLfQ69A/yjG9HHba2+PDgwSkN3FttrmG+70ZGx21sElNFouK13RzyA==",
     "MPL-2.0 (core), MIT and Zlib (vendor/pako)", "novnc",
     {"core/**/*.js": "", "vendor/pako/lib/**/*.js": "", "vendor/pako/LICENSE": "vendor/pako/LICENSE.txt",
      "LICENSE.txt": "LICENSE.txt", "AUTHORS": "AUTHORS.txt"}),
]


def integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def main() -> int:
    manifest = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, version, expected, licence, target, files in PACKAGES:
            out = subprocess.run(["npm", "pack", f"{name}@{version}", "--pack-destination", tmp, "--silent"],
                                 check=True, capture_output=True, text=True).stdout.split()[-1]
            tarball = Path(tmp) / out
            got = integrity(tarball.read_bytes())
            if got != expected:
                print(f"{name}@{version}: integrity {got}, expected {expected}", file=sys.stderr)
                return 1
            unpacked = Path(tmp) / target
            with tarfile.open(tarball) as tar:
                tar.extractall(unpacked, filter="data")
            package = unpacked / "package"
            dest = VENDOR / target
            shutil.rmtree(dest, ignore_errors=True)
            copied = {}
            for pattern, rename in files.items():
                for source in sorted(package.glob(pattern)):
                    relative = rename or str(source.relative_to(package))
                    (dest / relative).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(source, dest / relative)
                    copied[relative] = hashlib.sha256(source.read_bytes()).hexdigest()
            manifest.append({"package": name, "version": version, "integrity": expected, "license": licence,
                             "directory": target, "files": copied})
    (VENDOR / "vendor.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"vendored {', '.join(f'{p[0]}@{p[1]}' for p in PACKAGES)} into {VENDOR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
