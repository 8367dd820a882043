{{/* The chart's name. */}}
{{- define "kubevbmc.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The name of the release's objects: the release name, with the chart's name unless it already holds it. */}}
{{- define "kubevbmc.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Labels that select the controller's pods (the Deployment's selector: never change them). */}}
{{- define "kubevbmc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubevbmc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller
{{- end }}

{{/* Labels on every object of the release. */}}
{{- define "kubevbmc.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kubevbmc.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* repository:tag of an image value; the tag defaults to the chart's appVersion. */}}
{{- define "kubevbmc.image" -}}
{{- printf "%s:%s" .image.repository (.image.tag | default .chart.AppVersion) }}
{{- end }}

{{/*
The chart's CRD (the controller's file) and what to do with it, for crd.yaml and NOTES.txt: "render" when no CRD of
that name exists (or Helm cannot look: `helm template`) or the one there is this release's (Helm's ownership
annotations name it); "skip" when it is another's but the same schema as this chart's (the digest annotation says
so: a CRD kept by an uninstalled release of another name, of this chart version); "refuse" otherwise (applied with
kubectl, another chart version's, another project's), which Helm could not take over anyway.
*/}}
{{- define "kubevbmc.crd" -}}
{{- .Files.Get "files/crds/bmc.kubevirt.io_virtualmachinebmcs.yaml" -}}
{{- end }}

{{- define "kubevbmc.crdDigest" -}}
{{- (include "kubevbmc.crd" . | fromYaml).spec | toJson | sha256sum | trunc 16 -}}
{{- end }}

{{- define "kubevbmc.crdDecision" -}}
{{- $name := (include "kubevbmc.crd" . | fromYaml).metadata.name -}}
{{- $existing := lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" $name -}}
{{- $annotations := dig "metadata" "annotations" (dict) $existing -}}
{{- if or (not $existing) (and (eq (get $annotations "meta.helm.sh/release-name") .Release.Name) (eq (get $annotations "meta.helm.sh/release-namespace") .Release.Namespace)) -}}
render
{{- else if eq (get $annotations "bmc.kubevirt.io/schema-digest") (include "kubevbmc.crdDigest" .) -}}
skip
{{- else -}}
refuse
{{- end -}}
{{- end }}

{{/* Who holds the existing CRD, for the messages: "Helm release R (namespace N)" or "no Helm release". */}}
{{- define "kubevbmc.crdHolder" -}}
{{- $name := (include "kubevbmc.crd" . | fromYaml).metadata.name -}}
{{- $annotations := dig "metadata" "annotations" (dict) (lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" $name) -}}
{{- with get $annotations "meta.helm.sh/release-name" -}}
Helm release {{ . }} (namespace {{ get $annotations "meta.helm.sh/release-namespace" }})
{{- else -}}
no Helm release (applied with kubectl, or by another tool)
{{- end -}}
{{- end }}

{{/* The one command that hands the existing CRD to this release. */}}
{{- define "kubevbmc.crdAdopt" -}}
{{- $name := (include "kubevbmc.crd" . | fromYaml).metadata.name -}}
kubectl annotate crd {{ $name }} meta.helm.sh/release-name={{ .Release.Name }} meta.helm.sh/release-namespace={{ .Release.Namespace }} --overwrite && kubectl label crd {{ $name }} app.kubernetes.io/managed-by=Helm --overwrite
{{- end }}
