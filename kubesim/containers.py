"""The container runtime of kubesim's node in container mode: podman, with runc, on storage of the run's own.

What it takes on the machines this runs on (Debian bookworm, a mixed cgroup v1/v2 layout, no container daemon):
- runc, not crun: crun refuses a hybrid cgroup layout ("cgroups in hybrid mode not supported");
- ulimits at most the process's hard limits: podman's defaults (nofile 1048576) are refused without
  CAP_SYS_RESOURCE ("error setting rlimits for ready process");
- host networking: a pod's processes bind its Pod IP on loopback (as the process kubelet's do), so Services,
  probes and clients reach them with no bridge and no firewall rules;
- images and containers under one directory (`storage`, e.g. the checkout's .containers/), never the machine's
  /var/lib/containers that other runs may use; podman's run-time state under a short path in the temporary
  directory (conmon's attach sockets must fit in a socket address, 108 bytes).

The kubelet calls `run_argv` (a pure function of the container's settings) and runs `podman run` attached, so the
container's output is that process's output and its exit status is the container's; it stops a container as the
CRI does (`podman kill` with SIGTERM, later SIGKILL) and removes what is left (`podman rm --force`).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

STORAGE_ENV = "KUBEVBMC_CONTAINERS"
DEFAULT_STORAGE = ".containers"
# Labels on every container the kubelet starts: which kubesim process started it (to find the ones a kubesim that
# died left running), and which pod and container it is.
SIM_PID_LABEL = "io.kubesim.pid"
POD_LABEL = "io.kubernetes.pod.uid"
NPROC_MAX = 32768
TIMEOUT = 60.0


def default_storage() -> str:
    """$KUBEVBMC_CONTAINERS, else .containers in the current directory (the checkout, for make and the tests)."""
    return os.path.abspath(os.environ.get(STORAGE_ENV) or DEFAULT_STORAGE)


def ulimits(limits: dict[str, tuple[int, int]] | None = None) -> list[str]:
    """--ulimit flags no higher than this process's hard limits (which a container may not exceed)."""
    if limits is None:
        limits = {"nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
                  "nproc": resource.getrlimit(resource.RLIMIT_NPROC)}
    out: list[str] = []
    for name, (_, hard) in sorted(limits.items()):
        value = NPROC_MAX if hard == resource.RLIM_INFINITY else hard
        if name == "nproc":
            value = min(value, NPROC_MAX)
        out += ["--ulimit", f"{name}={value}:{value}"]
    return out


@dataclass(frozen=True)
class Mount:
    source: str  # a host path
    destination: str  # the path in the container
    read_only: bool = False


@dataclass
class RunSpec:
    """What `podman run` needs to start one container of a pod, decided by the kubelet from the pod spec."""

    name: str
    image: str
    entrypoint: list[str] | None  # the container's `command` (replaces the image's ENTRYPOINT and CMD)
    args: list[str]  # the container's `args` (replace the image's CMD)
    env: dict[str, str]
    hostname: str
    user: str | None = None  # "uid" or "uid:gid"; None: the image's USER
    groups: list[int] = field(default_factory=list)  # fsGroup and supplementalGroups
    read_only: bool = False
    cap_add: list[str] = field(default_factory=list)
    cap_drop: list[str] = field(default_factory=list)
    no_new_privileges: bool = False
    seccomp_unconfined: bool = True  # Kubernetes' default without a seccompProfile
    mounts: list[Mount] = field(default_factory=list)
    workdir: str | None = None
    labels: dict[str, str] = field(default_factory=dict)


def run_argv(spec: RunSpec, limits: Sequence[str] = ()) -> list[str]:
    """`podman run` arguments (after the global ones) for one container, attached and removed when it exits."""
    argv = ["run", "--rm", "--replace", "--pull", "never", "--name", spec.name, "--network", "host",
            "--hostname", spec.hostname, "--log-driver", "none", *limits]
    # podman's own additions to the environment, which a CRI runtime does not make (the image's ENV stays).
    argv += ["--unsetenv", "TERM", "--unsetenv", "container"]
    for key, value in sorted(spec.labels.items()):
        argv += ["--label", f"{key}={value}"]
    if spec.user is not None:
        argv += ["--user", spec.user]
    for group in spec.groups:
        argv += ["--group-add", str(group)]
    if spec.read_only:
        # Only the volumes are writable, as in a pod: no tmpfs on /tmp, /var/tmp and /run that podman would add.
        argv += ["--read-only", "--read-only-tmpfs=false"]
    for cap in spec.cap_drop:
        argv += ["--cap-drop", cap]
    for cap in spec.cap_add:
        argv += ["--cap-add", cap]
    if spec.no_new_privileges:
        argv += ["--security-opt", "no-new-privileges"]
    if spec.seccomp_unconfined:
        argv += ["--security-opt", "seccomp=unconfined"]
    for mount in spec.mounts:
        option = f"type=bind,source={mount.source},destination={mount.destination}"
        argv += ["--mount", option + (",ro=true" if mount.read_only else "")]
    if spec.workdir:
        argv += ["--workdir", spec.workdir]
    for key, value in spec.env.items():
        argv += ["--env", f"{key}={value}"]
    if spec.entrypoint is not None:
        argv += ["--entrypoint", json.dumps(spec.entrypoint)]
    return [*argv, spec.image, *spec.args]


@dataclass(frozen=True)
class Image:
    id: str
    user: str  # the image's USER ("" means root)


class Podman:
    """podman on `storage`, with runc and cgroupfs (the machine's systemd is not asked for anything)."""

    def __init__(self, storage: str | None = None) -> None:
        self.storage = os.path.abspath(storage or default_storage())
        digest = hashlib.sha256(self.storage.encode()).hexdigest()[:12]
        self.runroot = os.path.join(tempfile.gettempdir(), f"kubevbmc-podman-{digest}")
        self.limits = ulimits()

    def storage_options(self) -> list[str]:
        """containers/storage's options, the same for podman and buildah."""
        return ["--root", os.path.join(self.storage, "storage"), "--runroot", self.runroot]

    def argv(self, *args: str) -> list[str]:
        return ["podman", *self.storage_options(), "--runtime", "runc", "--cgroup-manager", "cgroupfs",
                "--events-backend", "file", *args]

    def call(self, *args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout, check=False,
                              stdin=subprocess.DEVNULL)

    def problem(self) -> str | None:
        """Why containers cannot run here (None: they can)."""
        for tool in ("podman", "runc"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed (Debian: apt-get install podman runc)"
        if os.geteuid() != 0:
            return "podman runs as root here (rootless podman cannot give a container the pod's users and volumes)"
        try:
            done = self.call("info", "--format", "{{.Store.GraphDriverName}}", timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"podman info failed: {exc}"
        if done.returncode != 0:
            return f"podman info failed: {done.stderr.strip()[-500:]}"
        return None

    def image(self, ref: str) -> Image | None:
        """The image in local storage, or None."""
        done = self.call("image", "inspect", "--format", "{{.Id}} {{.Config.User}}", ref)
        if done.returncode != 0:
            return None
        image_id, _, user = done.stdout.strip().partition(" ")
        return Image(image_id, user)

    def pull(self, ref: str, timeout: float = TIMEOUT) -> str | None:
        """Pull an image; None on success, else podman's reason."""
        try:
            done = self.call("pull", "--quiet", ref, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"pulling {ref} timed out after {timeout:g}s"
        return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["pull failed"])[-1]

    def run_command(self, spec: RunSpec) -> list[str]:
        return self.argv(*run_argv(spec, self.limits))

    def exec_command(self, name: str, argv: list[str]) -> list[str]:
        return self.argv("exec", name, *argv)

    def kill(self, name: str, signal: int) -> bool:
        """Signal the container's main process, as the CRI's StopContainer does. False if it is not running."""
        return self.call("kill", "--signal", str(signal), name, timeout=30).returncode == 0

    def remove(self, *names: str) -> None:
        if names:
            self.call("rm", "--force", "--ignore", "--time", "0", *names, timeout=60)

    def orphans(self) -> list[str]:
        """Containers started by a kubesim process that no longer runs (its kubelet could not remove them)."""
        done = self.call("ps", "--all", "--filter", f"label={SIM_PID_LABEL}", "--format",
                         "{{.Names}} {{index .Labels \"" + SIM_PID_LABEL + "\"}}")
        found = []
        for line in done.stdout.splitlines() if done.returncode == 0 else []:
            name, _, pid = line.strip().partition(" ")
            if pid.isdigit() and not _running(int(pid)):
                found.append(name)
        return found


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
