"""Access to the BMC: who may log in (`throttle`: the login throttle shared by IPMI and Redfish) and what they did
(`audit`: one audit line per action and failed login; `keeping`: what keeps the audit trail and the SEL beyond
the process).

Imports nothing else of vbmc: the Machine backends and both frontends use it.
"""
