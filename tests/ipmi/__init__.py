"""The IPMI frontend (vbmc/ipmi/): real IPMI clients (ipmitool, freeipmi, pyghmi) against agents, Serial over LAN."""
