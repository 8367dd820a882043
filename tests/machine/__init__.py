"""The Machine model and its backends (vbmc/machine/): the event bus, boot orders, KubeVirtMachine against kubesim."""
