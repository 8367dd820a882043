"""kubesim: the simulated Kubernetes API server and KubeVirt, as the agent and the controller rely on them."""
