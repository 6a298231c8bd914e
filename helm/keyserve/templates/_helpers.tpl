{{/*
Names, labels and the image: the small helpers every template uses.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "keyserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name: fullnameOverride, else "<release>-<name>" (or just the
release name when it already contains the chart name). Kept to 40 characters because KubeRay
appends suffixes (a RayService's cluster gets "-raycluster-xxxxx", its pods more).
*/}}
{{- define "keyserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "keyserve-0.1.0" for the helm.sh/chart label. */}}
{{- define "keyserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that identify this release's pods (stable across upgrades). */}}
{{- define "keyserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "keyserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The standard labels of every object. */}}
{{- define "keyserve.labels" -}}
helm.sh/chart: {{ include "keyserve.chart" . }}
{{ include "keyserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: keyserve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* "true" when the main worker group or any enabled additional group has GPUs, else "". */}}
{{- define "keyserve.anyGpu" -}}
{{- $gpu := and .Values.worker.enabled (eq .Values.worker.accelerator "nvidia") }}
{{- range $name, $group := .Values.additionalWorkerGroups }}
{{- if and (not $group.disabled) (eq ($group.accelerator | default "cpu") "nvidia") }}
{{- $gpu = true }}
{{- end }}
{{- end }}
{{- if $gpu }}true{{ end }}
{{- end }}

{{/* The image reference; the default tag follows the hardware: "<appVersion>-cuda" or "-cpu". */}}
{{- define "keyserve.image" -}}
{{- $variant := ternary "cuda" "cpu" (eq (include "keyserve.anyGpu" .) "true") }}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion $variant) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* The Secret holding the API key, or "" when the server runs without one. */}}
{{- define "keyserve.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else if .Values.apiKey.create }}
{{- printf "%s-api-key" (include "keyserve.fullname" .) }}
{{- end }}
{{- end }}

{{/* GPUs per pod of the main worker group: gpusPerPod, else the tensor-parallel size. */}}
{{- define "keyserve.mainWorkerGpus" -}}
{{- $tp := int .Values.model.tensorParallelSize }}
{{- if ne .Values.worker.accelerator "nvidia" }}0
{{- else if kindIs "invalid" .Values.worker.gpusPerPod }}{{ $tp }}
{{- else }}
{{- $gpus := int .Values.worker.gpusPerPod }}
{{- if ne (mod $gpus $tp) 0 }}
{{- fail (printf "worker.gpusPerPod (%d) must be a multiple of model.tensorParallelSize (%d): one model replica's %d shards run on one node" $gpus $tp $tp) }}
{{- end }}
{{- $gpus }}
{{- end }}
{{- end }}
