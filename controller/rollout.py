"""Rolling a new agent template out to the fleet: one agent first (the canary), then batches, halting when an
updated agent does not become ready.

What changes every agent at once is the fleet's part of the pod template: the image, its pull policy and
Secrets, the agents' log level, their node loss tolerations, and the template's shape (TEMPLATE_VERSION, bumped
when this controller changes what it renders). Its digest is the pod template annotation REVISION. A Deployment
whose revision is not the target waits for its turn; meanwhile a change of its BMC's own inputs (its Secret, its
VM, its spec) is applied at once, rendered with the fleet settings the Deployment already runs
(`running_settings`).

The plan is a pure function of the agent Deployments as the API server has them, computed at every reconcile:
nothing is kept in memory or annotations, so a controller restarted mid-rollout carries on where it was. An
updated agent fails when its Deployment reports ProgressDeadlineExceeded (the deployment controller's own
verdict, after progressDeadlineSeconds = --rollout-timeout): the rollout then halts until the template changes
again (a corrected image), and the failed agent is the first to get the new one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from . import verdicts
from .settings import Settings

Obj = dict[str, Any]
Key = tuple[str, str]

REVISION = "bmc.kubevirt.io/agent-revision"
TEMPLATE_VERSION = "4"  # the pod template's shape: bumped with every change of what desired renders


def revision(settings: Settings) -> str:
    fleet = [TEMPLATE_VERSION, settings.agent_image, settings.agent_image_pull_policy,
             list(settings.agent_image_pull_secrets), settings.agent_log_level, settings.agent_node_loss_toleration]
    return hashlib.sha256(json.dumps(fleet).encode()).hexdigest()[:10]


def _template(deployment: Obj | None) -> Obj:
    return (((deployment or {}).get("spec") or {}).get("template") or {})


def revision_of(deployment: Obj | None) -> str:
    return str((_template(deployment).get("metadata") or {}).get("annotations", {}).get(REVISION) or "")


def running_settings(settings: Settings, deployment: Obj) -> Settings | None:
    """`settings` with the fleet fields `deployment` runs now; None when they do not reproduce its revision (it
    was rendered by another version of this controller: only its turn in the rollout may change it)."""
    pod = _template(deployment).get("spec") or {}
    container: Obj = next(iter(pod.get("containers") or []), {})
    args = [str(a) for a in container.get("args") or []]
    level = args[args.index("--log-level") + 1] if "--log-level" in args[:-1] else settings.agent_log_level
    toleration = next((int(t["tolerationSeconds"]) for t in pod.get("tolerations") or []
                       if t.get("tolerationSeconds") is not None), settings.agent_node_loss_toleration)
    running = dataclasses.replace(
        settings, agent_image=str(container.get("image") or ""),
        agent_image_pull_policy=str(container.get("imagePullPolicy") or ""),
        agent_image_pull_secrets=tuple(str(s.get("name")) for s in pod.get("imagePullSecrets") or []),
        agent_log_level=level, agent_node_loss_toleration=toleration)
    return running if revision(running) == revision_of(deployment) else None


def batch_size(batch: str, total: int) -> int:
    if batch.endswith("%"):
        return max(1, math.ceil(total * int(batch[:-1]) / 100))
    return max(1, int(batch))


def key_of(obj: Obj) -> Key:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def up_to_date(target: str, image: str) -> tuple[bool, str, str]:
    return True, "UpToDate", f"the agent runs revision {target} ({image})"


@dataclass(frozen=True)
class Plan:
    target: str  # the revision being rolled out
    image: str
    total: int  # agent Deployments
    outdated: tuple[Key, ...]  # not at the target, in rollout order
    allowed: frozenset[Key]  # outdated ones that may take the target now
    halted_by: Key | None = None  # an updated agent that did not become ready in time
    halted_why: str = ""

    def state(self, key: Key) -> tuple[bool, str, str]:
        """(up to date, reason, message) of the AgentUpToDate condition for the agent Deployment `key`."""
        if key not in self.outdated or key in self.allowed:
            return up_to_date(self.target, self.image)
        if self.halted_by is not None:
            return False, "RolloutHalted", (
                f"the rollout of agent revision {self.target} ({self.image}) is halted: agent Deployment "
                f"{'/'.join(self.halted_by)} did not become ready ({self.halted_why}); this BMC keeps its "
                "current agent until the template changes again")
        return False, "RolloutPending", (f"waiting for its turn in the rollout of agent revision {self.target} "
                                         f"({self.image})")


def plan(deployments: Iterable[Obj], settings: Settings) -> Plan:
    """Which outdated agents may be updated now: none while an updated agent is on its way to ready or has
    failed; else one (the canary) until some updated agent is ready, then a batch."""
    target = revision(settings)
    agents = list(deployments)
    outdated: list[tuple[int, Key]] = []
    in_flight, updated_ready = 0, 0
    halted: list[tuple[Key, str]] = []
    for d in agents:
        key = key_of(d)
        ready = verdicts.agent_readiness(d)[0]
        if revision_of(d) != target:
            outdated.append((1 if ready else 0, key))  # a broken agent cannot get worse: first
        elif ready:
            updated_ready += 1
        elif why := verdicts.progress_deadline_exceeded(d):
            halted.append((key, why))
        else:
            in_flight += 1
    order = tuple(key for _, key in sorted(outdated))
    allowed: frozenset[Key] = frozenset()
    if not halted and not in_flight:
        allowed = frozenset(order[:batch_size(settings.rollout_batch, len(agents)) if updated_ready else 1])
    # A rollout halts only when it holds outdated agents back: a broken agent at the target revision with nothing
    # left to update is that BMC's Ready=False (status.py), not the fleet's halt.
    first = min(halted) if halted and order else (None, "")
    return Plan(target=target, image=settings.agent_image, total=len(agents), outdated=order, allowed=allowed,
                halted_by=first[0], halted_why=first[1])
