"""The Redfish frontend (vbmc/redfish/): real Redfish clients (sushy, DMTF's library, redfishtool, DMTF's
validators), the EventService, virtual media, hostile HTTP."""
