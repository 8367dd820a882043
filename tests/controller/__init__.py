"""The controller (controller/): reconciling VirtualMachineBMCs, fleets, pools, rollouts, certificates, failover."""
