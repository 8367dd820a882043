"""kubesim: a simulated Kubernetes API server that plays KubeVirt's part, for tests and the demo."""
