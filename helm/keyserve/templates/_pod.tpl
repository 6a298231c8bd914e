{{/*
Pieces shared by the head and worker pods: environment, volumes, volume mounts.
Each takes a dict: "root" (the top context), "group" (the head / worker values) and, for the
volumes, "batch" (true in the RayJob: the head mounts the batch data claim).
*/}}

{{/* Environment of every Ray container: the model cache, the API key, then user extras. */}}
{{- define "keyserve.env" -}}
{{- $root := .root }}
- name: KEYSERVE_CACHE_DIR
  value: {{ $root.Values.cache.mountPath | quote }}
{{- with include "keyserve.apiKeySecretName" $root }}
- name: KEYSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . | quote }}
      key: {{ $root.Values.apiKey.secretKey | quote }}
{{- end }}
{{- with $root.Values.containerEnv }}
{{ toYaml . }}
{{- end }}
{{- with .group.containerEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volumes of a Ray pod. */}}
{{- define "keyserve.volumes" -}}
{{- $root := .root }}
- name: keyserve-cache
  {{- with $root.Values.cache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ . | quote }}
  {{- else }}
  emptyDir:
    sizeLimit: {{ $root.Values.cache.sizeLimit | quote }}
  {{- end }}
{{- if $root.Values.sharedMemory.enabled }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $root.Values.sharedMemory.sizeLimit | quote }}
{{- end }}
{{- if .batch }}
- name: batch-data
  persistentVolumeClaim:
    claimName: {{ $root.Values.batchJob.data.existingClaim | quote }}
{{- end }}
{{- with .group.volumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volume mounts of a Ray container (matching keyserve.volumes). */}}
{{- define "keyserve.volumeMounts" -}}
{{- $root := .root }}
- name: keyserve-cache
  mountPath: {{ $root.Values.cache.mountPath | quote }}
{{- if $root.Values.sharedMemory.enabled }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- if .batch }}
- name: batch-data
  mountPath: {{ $root.Values.batchJob.data.mountPath | quote }}
{{- end }}
{{- with .group.volumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by head and workers: pull secrets, account, security, placement. */}}
{{- define "keyserve.podSettings" -}}
{{- $root := .root }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.serviceAccountName }}
serviceAccountName: {{ . | quote }}
{{- end }}
{{- with $root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
