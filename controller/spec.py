"""The VirtualMachineBMC spec as the controller reads it (the CRD's schema fills the defaults on a real API
server; these defaults repeat them for objects read from elsewhere)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

GROUP, VERSION, KIND = "bmc.kubevirt.io", "v1beta1", "VirtualMachineBMC"
API_VERSION = f"{GROUP}/{VERSION}"
POOL_PATTERN, POOL_MAX_LENGTH = r"^[a-z]([-a-z0-9]*[a-z0-9])?$", 40  # spec.agentPool, as the CRD's schema says


class _Model(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class NameRef(_Model):
    name: str


class Ipmi(_Model):
    enabled: bool = True


class RedfishTLS(_Model):
    secret_ref: NameRef | None = Field(default=None, alias="secretRef")


class MediaStorage(_Model):
    storage_class_name: str | None = Field(default=None, alias="storageClassName")
    volume_mode: Literal["Filesystem", "Block"] | None = Field(default=None, alias="volumeMode")


class MediaTLS(_Model):
    ca_bundle_config_map_ref: NameRef | None = Field(default=None, alias="caBundleConfigMapRef")


class VirtualMedia(_Model):
    storage: MediaStorage = Field(default_factory=MediaStorage)
    tls: MediaTLS = Field(default_factory=MediaTLS)


class Redfish(_Model):
    enabled: bool = True
    tls: RedfishTLS = Field(default_factory=RedfishTLS)
    require_tls: bool = Field(default=False, alias="requireTLS")
    virtual_media: VirtualMedia = Field(default_factory=VirtualMedia, alias="virtualMedia")


class ServiceOptions(_Model):
    # Unset: the controller's --default-service-type (so the CRD schema gives this field no default).
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] | None = None
    annotations: dict[str, str] = Field(default_factory=dict)


class BMCSpec(_Model):
    virtual_machine_ref: NameRef = Field(alias="virtualMachineRef")
    auth_secret_ref: NameRef | None = Field(default=None, alias="authSecretRef")
    # The shared agent serving this BMC (unset: a dedicated one). The CRD's pattern; repeated for other sources.
    agent_pool: str | None = Field(default=None, alias="agentPool", pattern=POOL_PATTERN, max_length=POOL_MAX_LENGTH)
    ipmi: Ipmi = Field(default_factory=Ipmi)
    redfish: Redfish = Field(default_factory=Redfish)
    service: ServiceOptions = Field(default_factory=ServiceOptions)

    @classmethod
    def of(cls, bmc: dict[str, Any]) -> BMCSpec:
        return cls.model_validate(bmc.get("spec") or {})
