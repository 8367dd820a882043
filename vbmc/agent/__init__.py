"""The agent process: `kubevbmc agent`.

`bmc` is the one composition of a BMC (its Machine, IPMI server, Redfish app, listeners, certificate, login
throttle, metrics and probes); `pool` serves a set of them on one event loop, either the one BMC of a dedicated
agent (from its flags) or the members of a pool (from the pool's Secret, watched); `command` is the command line.

May import every other vbmc package but the entry points.
"""
