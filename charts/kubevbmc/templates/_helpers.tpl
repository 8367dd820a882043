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
