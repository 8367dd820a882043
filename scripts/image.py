#!/usr/bin/env python3
"""`make image`: the KubeVBMC image, built from the Dockerfile with what the machine has.

The builder is podman (or buildah) when installed, else Docker when its daemon answers; with neither, podman, runc
and mmdebstrap are installed from Debian's packages (apt-get). podman and buildah keep images in the storage that
kubesim's container kubelet runs them from (kubesim/containers.py: $KUBEVBMC_CONTAINERS, else .containers here),
with runc, host networking and ulimits the machine allows.

The Dockerfile's base (`ARG BASE`, Debian's own bookworm-slim image) is pulled when a registry answers; where none
does, the same thing is made from Debian's packages with mmdebstrap (minbase, merged /usr, the slim image's dpkg
excludes) and imported under the base's name. That tarball is cached per machine (~/.cache/kubevbmc), keyed by
its recipe and the week, so a fresh checkout does not build it again. Where the machine re-signs TLS (a CA of its
own in /usr/local/share/ca-certificates), those certificates go into the base so that pip trusts PyPI in the build.

Inputs are reproducible: SOURCE_DATE_EPOCH is the last commit's time (the image's and its files' timestamps, the
wheel, hash-based bytecode), Python packages are pinned by constraints.txt, Debian's by DEBIAN_SNAPSHOT if given.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from kubesim.containers import Podman  # noqa: E402  (the repository's own package, not installed here)

DEFAULT_TAGS = ("kubevbmc:dev",)
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kubevbmc"
LOCAL_CAS = Path("/usr/local/share/ca-certificates")
# What Debian's bookworm-slim image leaves out (debuerreotype's slimify): docs but their copyright, man pages,
# translations. The same list goes into the base's /etc/dpkg/dpkg.cfg.d, so later installs leave them out too.
SLIM_EXCLUDES = ("path-exclude /usr/share/doc/*", "path-include /usr/share/doc/*/copyright",
                 "path-exclude /usr/share/man/*", "path-exclude /usr/share/groff/*", "path-exclude /usr/share/info/*",
                 "path-exclude /usr/share/lintian/*", "path-exclude /usr/share/linda/*",
                 "path-exclude /usr/share/locale/*")
BASE_CONFIG = ("ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", 'CMD ["bash"]')


def log(message: str) -> None:
    print(f"image: {message}", file=sys.stderr, flush=True)


# ---- pure decisions


def dockerfile_base(text: str) -> str:
    """The default of the Dockerfile's `ARG BASE=...` (both stages are FROM ${BASE})."""
    match = re.search(r"^ARG BASE=(\S+)\s*$", text, re.MULTILINE)
    if not match:
        raise SystemExit("image: the Dockerfile declares no `ARG BASE=<image>`")
    return match.group(1)


def debian_suite(base: str) -> str:
    """The Debian suite a `debian:<suite>[-slim]` base holds; SystemExit for a base mmdebstrap cannot make."""
    repository, _, tag = base.rpartition("/")[2].partition(":")
    suite = tag.removesuffix("-slim")
    if repository != "debian" or not re.fullmatch(r"[a-z]+", suite):
        raise SystemExit(f"image: cannot make {base} from Debian's packages (only debian:<suite>[-slim])")
    return suite


def sources(suite: str, mirror: str, security: str) -> list[str]:
    return [f"deb {mirror} {suite} main", f"deb {mirror} {suite}-updates main",
            f"deb {security} {suite}-security main"]


def base_key(suite: str, lines: Sequence[str], cas: Sequence[bytes], week: str) -> str:
    """The cached base tarball's key: its recipe, the machine's extra CAs, and the week (security updates)."""
    recipe = "\n".join([suite, *lines, *SLIM_EXCLUDES, *BASE_CONFIG, week])
    digest = hashlib.sha256(recipe.encode())
    for ca in cas:
        digest.update(ca)
    return digest.hexdigest()[:16]


def choose_builder(have: dict[str, bool], wanted: str = "auto") -> str | None:
    """podman, then buildah (they share kubesim's storage), then Docker with a daemon; None: nothing usable."""
    if wanted != "auto":
        return wanted
    return next((tool for tool in ("podman", "buildah", "docker") if have.get(tool)), None)


def source_date_epoch() -> str:
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return os.environ["SOURCE_DATE_EPOCH"]
    done = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%ct"], capture_output=True, text=True,
                          check=False)
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "0"


# ---- tools


def run(argv: Sequence[str], **kwargs: object) -> None:
    done = subprocess.run(list(argv), check=False, **kwargs)  # type: ignore[call-overload]
    if done.returncode != 0:
        raise SystemExit(f"image: `{' '.join(argv[:4])} ...` failed with exit status {done.returncode}")


def docker_daemon() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def install_tools() -> None:
    """podman, runc and mmdebstrap from Debian's packages (what a machine without a builder needs)."""
    missing = [tool for tool in ("podman", "runc", "mmdebstrap") if shutil.which(tool) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise SystemExit(f"image: {', '.join(missing)} missing and no apt-get here: install podman, runc and "
                         "mmdebstrap with your package manager, or run Docker")
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    log(f"installing {' '.join(missing)} (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run([*sudo, "apt-get", "update", "-qq"], env=env)
    run([*sudo, "apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], env=env)


class Builder:
    """One of podman, buildah or docker, with the flags these machines need."""

    def __init__(self, tool: str, podman: Podman) -> None:
        self.tool, self.podman = tool, podman

    def argv(self, *args: str) -> list[str]:
        if self.tool == "docker":
            return ["docker", *args]
        if self.tool == "podman":
            return self.podman.argv(*args)
        return ["buildah", *self.podman.storage_options(), *args]

    def has(self, image: str) -> bool:
        args = ("image", "inspect", image) if self.tool != "buildah" else ("inspect", "--type", "image", image)
        return subprocess.run(self.argv(*args), capture_output=True, check=False).returncode == 0

    def pull(self, image: str) -> bool:
        log(f"pulling {image}")
        return subprocess.run(self.argv("pull", "--quiet", image), capture_output=True, check=False,
                              timeout=600).returncode == 0

    def import_tarball(self, tarball: Path, image: str) -> None:
        changes = [arg for change in BASE_CONFIG for arg in ("--change", change)]
        if self.tool == "buildah":  # buildah has no import: podman shares its storage
            run(self.podman.argv("import", "--quiet", *changes, str(tarball), image), stdout=subprocess.DEVNULL)
        else:
            run(self.argv("import", "--quiet" if self.tool == "podman" else "-q", *changes, str(tarball), image),
                stdout=subprocess.DEVNULL)

    def build(self, tags: Sequence[str], build_args: dict[str, str], epoch: str, cache: bool = True) -> None:
        args = [arg for key, value in build_args.items() for arg in ("--build-arg", f"{key}={value}")]
        if not cache:
            args.append("--no-cache")
        args += [arg for tag in tags for arg in ("--tag", tag)]
        if self.tool == "docker":
            run(["docker", "build", "--network", "host", *args, str(REPO)])
            return
        common = ["--network", "host", "--layers", "--timestamp", epoch, *self.podman.limits, *args]
        if self.tool == "podman":
            run(self.podman.argv("build", *common, str(REPO)))
        else:
            run(self.argv("bud", "--runtime", "runc", *common, str(REPO)))


def make_base(builder: Builder, base: str, source: str) -> None:
    """The Dockerfile's base in the builder's storage: there already, pulled, or made with mmdebstrap."""
    if builder.has(base):
        return
    if source in ("auto", "pull") and builder.pull(base):
        return
    if source == "pull":
        raise SystemExit(f"image: cannot pull {base}")
    suite = debian_suite(base)
    mirror = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
    security = os.environ.get("DEBIAN_SECURITY_MIRROR", "http://deb.debian.org/debian-security")
    lines = sources(suite, mirror, security)
    cas = sorted(LOCAL_CAS.glob("*.crt")) if LOCAL_CAS.is_dir() else []
    week = datetime.date.today().strftime("%G-W%V")
    tarball = CACHE / "base" / f"{suite}-{base_key(suite, lines, [c.read_bytes() for c in cas], week)}.tar"
    if not tarball.exists():
        log(f"{base} cannot be pulled: making it from Debian's packages ({tarball})")
        tarball.parent.mkdir(parents=True, exist_ok=True)
        for old in tarball.parent.glob(f"{suite}-*.tar"):
            old.unlink()  # last week's
        if shutil.which("mmdebstrap") is None:
            install_tools()
        hooks = ['mkdir -p "$1/etc/dpkg/dpkg.cfg.d" "$1/usr/local/share/ca-certificates"',
                 "printf '%s\\n' " + " ".join(f"'{rule}'" for rule in SLIM_EXCLUDES)
                 + ' > "$1/etc/dpkg/dpkg.cfg.d/docker"',
                 *(f'cp {ca} "$1/usr/local/share/ca-certificates/"' for ca in cas),
                 'rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/*']
        options = [f"--dpkgopt={rule.replace(' ', '=', 1)}" for rule in SLIM_EXCLUDES]
        options += [f"--customize-hook={hook}" for hook in hooks]
        partial = Path(tempfile.mkdtemp(dir=tarball.parent)) / "base.tar"
        try:
            run(["mmdebstrap", "--variant=minbase", "--quiet", "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
                 *options, suite, str(partial), *lines],
                env={**os.environ, "SOURCE_DATE_EPOCH": source_date_epoch()},
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            partial.rename(tarball)
        finally:
            shutil.rmtree(partial.parent, ignore_errors=True)
    builder.import_tarball(tarball, base)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/image.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", action="append", help=f"image name (repeatable; default {DEFAULT_TAGS[0]})")
    parser.add_argument("--builder", choices=("auto", "podman", "buildah", "docker"), default="auto")
    parser.add_argument("--base", choices=("auto", "pull", "debian"), default="auto",
                        help="where the base comes from: a registry if one answers (auto), only a registry, or "
                             "only Debian's packages")
    parser.add_argument("--check-reproducible", action="store_true",
                        help="then build it twice more without any cache and check that both are the same image "
                             "(podman or buildah; a few minutes)")
    args = parser.parse_args(argv)
    tags = args.tag or list(DEFAULT_TAGS)

    have = {"podman": shutil.which("podman") is not None, "buildah": shutil.which("buildah") is not None}
    if args.builder in ("auto", "docker") and not (have["podman"] or have["buildah"]):
        have["docker"] = docker_daemon()
    tool = choose_builder(have, args.builder)
    if tool is None or (tool in ("podman", "buildah") and shutil.which("runc") is None):
        install_tools()
        tool = tool or "podman"
    podman = Podman()
    if tool != "docker":
        problem = podman.problem()
        if problem:
            raise SystemExit(f"image: containers cannot run here: {problem}")
    builder = Builder(tool, podman)
    dockerfile = (REPO / "Dockerfile").read_text()
    base = dockerfile_base(dockerfile)
    make_base(builder, base, args.base)

    epoch = source_date_epoch()
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    build_args = {"VERSION": version, "SOURCE_DATE_EPOCH": epoch}
    if os.environ.get("DEBIAN_SNAPSHOT"):
        build_args["DEBIAN_SNAPSHOT"] = os.environ["DEBIAN_SNAPSHOT"]
    log(f"building {', '.join(tags)} with {tool} (SOURCE_DATE_EPOCH={epoch})")
    builder.build(tags, build_args, epoch)
    if tool != "docker":  # what earlier builds left (their layers stay a day, as a cache for the next ones)
        podman.call("image", "prune", "--force", "--filter", "until=24h", timeout=300)
    # Built is not enough: the tests run it. A machine whose runtime refuses containers says so here.
    if tool != "docker":
        ran = podman.call("run", "--rm", "--network", "host", *podman.limits, tags[0], "--help", timeout=120)
        if ran.returncode != 0:
            raise SystemExit(f"image: built {tags[0]}, but containers cannot run here: {ran.stderr.strip()[-800:]}")
    log(f"built {', '.join(tags)}" + ("" if tool == "docker" else f" in {podman.storage}, and it runs"))
    if args.check_reproducible and tool != "docker":
        return check_reproducible(builder, tags[0], build_args, epoch)
    return 0


def check_reproducible(builder: Builder, tag: str, build_args: dict[str, str], epoch: str) -> int:
    """Two builds from nothing but the base: the same inputs must give the same image ID. (A build from the layer
    cache may differ: layers cached by a build at another commit keep that build's file timestamps.)"""
    def image_id(ref: str) -> str:
        return builder.podman.call("image", "inspect", "--format", "{{.Id}}", ref).stdout.strip()

    ids: dict[str, str] = {}
    for attempt in ("again-1", "again-2"):
        ref = f"{tag.rsplit(':', 1)[0]}:{attempt}"
        builder.build([ref], build_args, epoch, cache=False)
        ids[ref] = image_id(ref)
        builder.podman.call("untag", ref)
    for ref, found in ids.items():
        log(f"{ref}: {found}")
    if len(set(ids.values())) != 1:
        log("not reproducible: the same inputs gave different images")
        return 1
    log("reproducible: two builds from scratch, one image")
    return 0


if __name__ == "__main__":
    sys.exit(main())
