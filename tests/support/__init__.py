"""Helpers the tests of every area share: the simulated cluster (`cluster`), agent processes and their clients
(`agents`), controller processes and VirtualMachineBMCs (`controllers`), VMs (`vms`) and a loopback image server
(`images`). Area-specific helpers live with their area (tests/ipmi/client.py, tests/redfish/fuzz.py)."""
