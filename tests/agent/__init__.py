"""The agent process (vbmc/agent/): dedicated and pooled agents, credentials, the login throttle, the audit trail,
and an unreachable API server."""
