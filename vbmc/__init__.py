"""KubeVBMC agent: a virtual BMC (IPMI and Redfish) for one KubeVirt virtual machine."""
