{{/*
The Ray cluster spec (ray.io/v1 RayClusterSpec) shared by the RayService and the RayJob.
Called with a dict: "root" (the top context) and "workload": "serve" (the head exposes the
Serve port) or "batch" (the head mounts the batch data claim). Pods are labelled
app.kubernetes.io/component=<workload>-head / <workload>-worker.
*/}}

{{/* rayStartParams as the CRD wants them: a map of strings. */}}
{{- define "keyserve.rayStartParams" -}}
{{- range $key, $value := . }}
{{ $key | quote }}: {{ $value | toString | quote }}
{{- end }}
{{- end }}

{{/* Pod-template labels: the selector labels and the component (no version: a new chart
     version must not, by itself, make KubeRay replace the cluster). */}}
{{- define "keyserve.podLabels" -}}
{{ include "keyserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- with .group.labels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The head group: scheduling, Serve controller, dashboard; never any GPU. */}}
{{- define "keyserve.headGroupSpec" -}}
{{- $root := .root }}
{{- $batch := eq .workload "batch" }}
{{- $head := $root.Values.head }}
{{- $params := merge (dict "num-gpus" "0") (deepCopy ($head.rayStartParams | default dict)) }}
rayStartParams:
  {{- include "keyserve.rayStartParams" $params | trim | nindent 2 }}
template:
  metadata:
    labels:
      {{- include "keyserve.podLabels" (dict "root" $root "group" $head "component" (printf "%s-head" .workload)) | trim | nindent 6 }}
    {{- with $head.annotations }}
    annotations:
      {{- toYaml . | nindent 6 }}
    {{- end }}
  spec:
    {{- include "keyserve.podSettings" (dict "root" $root "group" $head "nodeSelector" $head.nodeSelector "tolerations" $head.tolerations) | trim | nindent 4 }}
    containers:
      - name: ray-head
        image: {{ include "keyserve.image" $root | quote }}
        imagePullPolicy: {{ $root.Values.image.pullPolicy | quote }}
        ports:
          - name: gcs-server
            containerPort: 6379
          - name: dashboard
            containerPort: 8265
          - name: client
            containerPort: 10001
          - name: metrics
            containerPort: 8080
          {{- if eq .workload "serve" }}
          - name: serve
            containerPort: {{ int $root.Values.serve.port }}
          {{- end }}
        env:
          {{- include "keyserve.env" (dict "root" $root "group" $head) | trim | nindent 10 }}
        resources:
          {{- toYaml $head.resources | nindent 10 }}
        {{- with $root.Values.securityContext }}
        securityContext:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        volumeMounts:
          {{- include "keyserve.volumeMounts" (dict "root" $root "group" $head "batch" $batch) | trim | nindent 10 }}
    volumes:
      {{- include "keyserve.volumes" (dict "root" $root "group" $head "batch" $batch) | trim | nindent 6 }}
{{- end }}

{{/*
One worker group: dict "root", "workload", "name" (group name), "group" (its values), "gpus"
(GPUs per pod, 0 for CPU-only). GPU groups get the GPU resource in requests and limits, the GPU
tolerations and node selector; CPU groups tell Ray they have no GPU.
*/}}
{{- define "keyserve.workerGroupSpec" -}}
{{- $root := .root }}
{{- $g := .group }}
{{- $gpus := int .gpus }}
{{- $replicas := int $g.replicas }}
{{- $min := int (ternary $replicas $g.minReplicas (kindIs "invalid" $g.minReplicas)) }}
{{- $max := int (ternary $replicas $g.maxReplicas (kindIs "invalid" $g.maxReplicas)) }}
{{- if or (lt $replicas $min) (gt $replicas $max) }}
{{- fail (printf "worker group %q: replicas (%d) must lie between minReplicas (%d) and maxReplicas (%d)" .name $replicas $min $max) }}
{{- end }}
{{- if and (ne ($g.accelerator | default "cpu") "nvidia") (not (kindIs "invalid" $g.gpusPerPod)) }}
{{- fail (printf "worker group %q sets gpusPerPod (%v) but its accelerator is %q: set accelerator to \"nvidia\" for GPU workers, or drop gpusPerPod" .name $g.gpusPerPod ($g.accelerator | default "cpu")) }}
{{- end }}
{{- $params := merge (dict "num-gpus" (toString $gpus)) (deepCopy ($g.rayStartParams | default dict)) }}
{{- $resources := deepCopy ($g.resources | default dict) }}
{{- $tolerations := $g.tolerations | default list }}
{{- $nodeSelector := deepCopy ($g.nodeSelector | default dict) }}
{{- if gt $gpus 0 }}
{{- $limits := $resources.limits | default dict }}
{{- $requests := $resources.requests | default dict }}
{{- $_ := set $limits $root.Values.gpu.resourceName $gpus }}
{{- $_ := set $requests $root.Values.gpu.resourceName $gpus }}
{{- $_ := set $resources "limits" $limits }}
{{- $_ := set $resources "requests" $requests }}
{{- $tolerations = concat $tolerations ($root.Values.gpu.tolerations | default list) }}
{{- $nodeSelector = merge $nodeSelector (deepCopy ($root.Values.gpu.nodeSelector | default dict)) }}
{{- end }}
- groupName: {{ .name | quote }}
  replicas: {{ $replicas }}
  minReplicas: {{ $min }}
  maxReplicas: {{ $max }}
  rayStartParams:
    {{- include "keyserve.rayStartParams" $params | trim | nindent 4 }}
  template:
    metadata:
      labels:
        {{- include "keyserve.podLabels" (dict "root" $root "group" $g "component" (printf "%s-worker" .workload)) | trim | nindent 8 }}
      {{- with $g.annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "keyserve.podSettings" (dict "root" $root "group" $g "nodeSelector" $nodeSelector "tolerations" $tolerations) | trim | nindent 6 }}
      containers:
        - name: ray-worker
          image: {{ include "keyserve.image" $root | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy | quote }}
          ports:
            - name: metrics
              containerPort: 8080
          env:
            {{- include "keyserve.env" (dict "root" $root "group" $g) | trim | nindent 12 }}
          {{- with $resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $root.Values.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            {{- include "keyserve.volumeMounts" (dict "root" $root "group" $g "batch" (and (eq .workload "batch") $root.Values.batchJob.data.mountOnWorkers)) | trim | nindent 12 }}
      volumes:
        {{- include "keyserve.volumes" (dict "root" $root "group" $g "batch" (and (eq .workload "batch") $root.Values.batchJob.data.mountOnWorkers)) | trim | nindent 8 }}
{{- end }}

{{/* The whole cluster spec. */}}
{{- define "keyserve.rayClusterSpec" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
rayVersion: {{ $v.rayVersion | quote }}
{{- if $v.autoscaler.enabled }}
enableInTreeAutoscaling: true
autoscalerOptions:
  idleTimeoutSeconds: {{ int $v.autoscaler.idleTimeoutSeconds }}
  upscalingMode: {{ $v.autoscaler.upscalingMode | quote }}
{{- end }}
headGroupSpec:
  {{- include "keyserve.headGroupSpec" . | trim | nindent 2 }}
{{- $groups := list }}
{{- if $v.worker.enabled }}
{{- $groups = append $groups (include "keyserve.workerGroupSpec" (dict "root" $root "workload" .workload "name" $v.worker.groupName "group" $v.worker "gpus" (include "keyserve.mainWorkerGpus" $root))) }}
{{- end }}
{{- range $name, $group := $v.additionalWorkerGroups }}
{{- if not $group.disabled }}
{{- $gpus := ternary ($group.gpusPerPod | default 0) 0 (eq ($group.accelerator | default "cpu") "nvidia") }}
{{- $groups = append $groups (include "keyserve.workerGroupSpec" (dict "root" $root "workload" $.workload "name" $name "group" $group "gpus" $gpus)) }}
{{- end }}
{{- end }}
{{- with $groups }}
workerGroupSpecs:
  {{- range . }}
  {{- . | trim | nindent 2 }}
  {{- end }}
{{- end }}
{{- end }}
