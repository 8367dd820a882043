"""The controller's settings: flags, with environment variables as defaults (as a Deployment sets them)."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

FIELD_MANAGER = "kubevbmc-controller"
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")  # a DNS subdomain


@dataclass(frozen=True)
class Settings:
    agent_image: str = "kubevbmc:dev"
    agent_image_pull_policy: str = ""  # "": the pod template leaves it to Kubernetes' default
    agent_image_pull_secrets: tuple[str, ...] = ()  # Secrets in each VirtualMachineBMC's namespace
    agent_log_level: str = "info"  # the agents' --log-level: debug also logs every IPMI read
    # How long an agent stays bound to a node that is unreachable or not ready before it is evicted and started on
    # another node: its tolerationSeconds of node.kubernetes.io/unreachable and not-ready (Kubernetes' default 300).
    agent_node_loss_toleration: int = 30
    default_service_type: str = "ClusterIP"  # for a VirtualMachineBMC that leaves spec.service.type unset
    namespace: str = ""  # "" watches every namespace
    workers: int = 8
    resync_seconds: float = 300.0
    certificate_duration: float = 365 * 86400.0  # the generated serving certificates' life, in seconds
    rollout_batch: str = "10%"  # agents updated at once after the canary: a count, or a percentage of the fleet
    rollout_timeout: int = 600  # seconds an updated agent has to become ready (progressDeadlineSeconds)
    field_manager: str = FIELD_MANAGER
    metrics_address: str = "127.0.0.1:8080"
    leader_elect: bool = True
    lease_name: str = "kubevbmc-controller"
    lease_namespace: str = "default"
    lease_duration: int = 15
    renew_deadline: int = 10
    retry_period: int = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--kubeconfig", default=env("KUBECONFIG", ""), help="default: $KUBECONFIG, else in-cluster")
    parser.add_argument("--agent-image", default=env("KUBEVBMC_AGENT_IMAGE", "kubevbmc:dev"),
                        help="the image of the agent pods (default %(default)s)")
    parser.add_argument("--agent-image-pull-policy", default=env("KUBEVBMC_AGENT_IMAGE_PULL_POLICY", ""),
                        choices=("", *PULL_POLICIES), help="imagePullPolicy of the agent pods (default: unset)")
    parser.add_argument("--agent-image-pull-secrets", default=env("KUBEVBMC_AGENT_IMAGE_PULL_SECRETS", ""),
                        type=secret_names, metavar="NAME[,NAME...]",
                        help="Secrets in each VirtualMachineBMC's namespace to pull the agent image with (default: "
                             "none)")
    parser.add_argument("--agent-log-level", default=env("KUBEVBMC_AGENT_LOG_LEVEL", "info"), choices=LOG_LEVELS,
                        help="the --log-level of the agents (default %(default)s; debug logs IPMI reads too)")
    parser.add_argument("--agent-node-loss-toleration", type=node_loss_toleration,
                        default=env("KUBEVBMC_AGENT_NODE_LOSS_TOLERATION", "30"), metavar="SECONDS",
                        help="how long an agent stays on a node that is unreachable or not ready before it is "
                             "evicted and started on another node: the agent pods' tolerationSeconds of "
                             "node.kubernetes.io/unreachable and not-ready (default %(default)s; Kubernetes gives "
                             "pods 300)")
    parser.add_argument("--default-service-type", default=env("KUBEVBMC_DEFAULT_SERVICE_TYPE", "ClusterIP"),
                        choices=SERVICE_TYPES,
                        help="the agent Service type when spec.service.type is unset (default %(default)s)")
    parser.add_argument("--namespace", default=env("KUBEVBMC_WATCH_NAMESPACE", ""),
                        help="watch one namespace only (default: all)")
    # Reconciles mostly wait on the API server: more workers than cores pay off (bench/controller.py).
    parser.add_argument("--workers", type=int, default=env("KUBEVBMC_WORKERS", "8"))  # argparse converts it
    parser.add_argument("--resync", type=float, default=env("KUBEVBMC_RESYNC_SECONDS", "300"),
                        metavar="SECONDS", help="reconcile every BMC at least this often (default %(default)s)")
    parser.add_argument("--certificate-duration", type=duration,
                        default=env("KUBEVBMC_CERTIFICATE_DURATION", "365d"), metavar="DURATION",
                        help="life of the generated Redfish certificates, renewed at 2/3 of it: seconds, or with "
                             "s, m, h or d (default %(default)s; from 30s to 1825d)")
    parser.add_argument("--rollout-batch", type=batch, default=env("KUBEVBMC_ROLLOUT_BATCH", "10%"),
                        metavar="N|P%",
                        help="when the agent template changes (a new --agent-image, agent flags), one agent is "
                             "updated first, then this many at a time (a count, or a percentage of all agents), "
                             "each batch once every updated agent is ready (default %(default)s)")
    parser.add_argument("--rollout-timeout", type=rollout_timeout, default=env("KUBEVBMC_ROLLOUT_TIMEOUT", "10m"),
                        metavar="DURATION",
                        help="an updated agent not ready within this long halts the rollout (the agent "
                             "Deployments' progressDeadlineSeconds): seconds, or with s, m or h (default "
                             "%(default)s; from 5s to 24h)")
    parser.add_argument("--metrics-address", default=env("KUBEVBMC_METRICS_ADDRESS", "127.0.0.1:8080"),
                        metavar="HOST:PORT", help="/metrics, /healthz and /readyz (port 0: a free one)")
    parser.add_argument("--leader-elect", default=env("KUBEVBMC_LEADER_ELECT", "true"),
                        choices=("true", "false"), help="hold a Lease before reconciling (default %(default)s)")
    parser.add_argument("--lease-namespace", default=env("POD_NAMESPACE", "default"))
    parser.add_argument("--lease-name", default="kubevbmc-controller")
    parser.add_argument("--log-level", default=env("KUBEVBMC_LOG_LEVEL", "info"))
    parser.add_argument("--log-format", default=env("KUBEVBMC_LOG_FORMAT", "text"), choices=LOG_FORMATS,
                        help="text lines, or one JSON object per line for log collectors (default %(default)s)")


def secret_names(text: str) -> tuple[str, ...]:
    """Comma-separated Secret names (DNS subdomains), without repeats; a bad one is an argparse error, so a pod
    spec the API server would refuse is never built."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = [n for n in names if len(n) > 253 or not SECRET_NAME.fullmatch(n)]
    if bad:
        raise argparse.ArgumentTypeError(f"not a Secret name (lowercase letters, digits, '-' and '.'): {bad[0]!r}")
    return names


DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd]?)")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """A duration in seconds from `90d`, `2160h`, `45m`, `30s` or `30`, from 30 seconds to 1825 days (half the
    CA's ten years)."""
    found = DURATION.fullmatch(text.strip())
    if not found:
        raise argparse.ArgumentTypeError(f"not a duration (a number with s, m, h or d): {text!r}")
    seconds = float(found.group(1)) * _UNIT[found.group(2)]
    if not 30 <= seconds <= 1825 * 86400:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: from 30s to 1825d")
    return seconds


BATCH = re.compile(r"([1-9][0-9]*)(%?)")


def batch(text: str) -> str:
    """A rollout batch: a count of agents (`5`) or a percentage of the fleet (`10%`, at most 100%)."""
    found = BATCH.fullmatch(text.strip())
    if not found or (found.group(2) and int(found.group(1)) > 100):
        raise argparse.ArgumentTypeError(f"not a batch size (a count such as 5, or a percentage such as 10%): {text!r}")
    return found.group(0)


def node_loss_toleration(text: str) -> int:
    """Whole seconds from 0 (evicted as soon as the node is found unreachable) to a day."""
    if not text.strip().isdigit() or not 0 <= int(text) <= 86400:
        raise argparse.ArgumentTypeError(f"not a number of seconds from 0 to 86400: {text!r}")
    return int(text)


def rollout_timeout(text: str) -> int:
    """Whole seconds from `10m`, `90s` or `90`, from 5 seconds to a day."""
    found = DURATION.fullmatch(text.strip())
    if not found or found.group(2) == "d":
        raise argparse.ArgumentTypeError(f"not a duration (a number with s, m or h): {text!r}")
    seconds = int(float(found.group(1)) * _UNIT[found.group(2)])
    if not 5 <= seconds <= 86400:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: from 5s to 24h")
    return seconds


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(agent_image=args.agent_image, agent_image_pull_policy=args.agent_image_pull_policy,
                    agent_image_pull_secrets=args.agent_image_pull_secrets,
                    agent_log_level=args.agent_log_level, agent_node_loss_toleration=args.agent_node_loss_toleration,
                    default_service_type=args.default_service_type, namespace=args.namespace,
                    workers=max(1, args.workers), resync_seconds=args.resync,
                    certificate_duration=args.certificate_duration, rollout_batch=args.rollout_batch,
                    rollout_timeout=args.rollout_timeout, metrics_address=args.metrics_address,
                    leader_elect=args.leader_elect == "true", lease_name=args.lease_name,
                    lease_namespace=args.lease_namespace)
