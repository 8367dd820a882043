"""The controller's Prometheus metrics, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

registry = CollectorRegistry()
reconciles = Counter("kubevbmc_controller_reconciles_total", "Reconciles, by result (success, error, requeue)",
                     ["result"], registry=registry)
reconcile_errors = Counter("kubevbmc_controller_reconcile_errors_total", "Reconciles that failed", registry=registry)
reconcile_duration = Histogram("kubevbmc_controller_reconcile_duration_seconds", "Time spent in one reconcile",
                               buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                               registry=registry)
queue_depth = Gauge("kubevbmc_controller_workqueue_depth", "Keys waiting in the work queue", registry=registry)
bmcs_ready = Gauge("kubevbmc_controller_bmcs_ready", "VirtualMachineBMCs whose Ready condition is True",
                   registry=registry)
bmcs_total = Gauge("kubevbmc_controller_bmcs", "VirtualMachineBMCs in the cache", registry=registry)
api_writes = Counter("kubevbmc_controller_api_writes_total", "Write requests to the API server, by verb",
                     ["verb"], registry=registry)
leader = Gauge("kubevbmc_controller_leader", "1 while this replica holds the leader Lease", registry=registry)
agents = Gauge("kubevbmc_controller_agents", "Agent Deployments (dedicated and pools)", registry=registry)
agents_outdated = Gauge("kubevbmc_controller_agents_outdated",
                        "Agent Deployments not yet at the current agent revision (a rollout in progress or halted)",
                        registry=registry)
rollout_halted = Gauge("kubevbmc_controller_rollout_halted",
                       "1 while the agents' rollout is halted by an updated agent that did not become ready",
                       registry=registry)
