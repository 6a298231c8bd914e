{{/*
The Ray Serve config (serveConfigV2) of the RayService, built as a dict and written with
toYaml so that it is always valid YAML. `args` go to keyserve.cluster.serve_app:build_app,
which validates them with its pydantic ServeArgs; optional ones appear only when set. The API
key never appears here: it reaches every Ray container as env KEYSERVE_API_KEY.
*/}}

{{/* build_app's args. */}}
{{- define "keyserve.serveArgs" -}}
{{- $v := .Values }}
{{- $args := dict
  "model" $v.model.name
  "dtype" $v.model.dtype
  "tp" (int $v.model.tensorParallelSize)
  "default_kv_policy" $v.kv.defaultPolicy
  "max_num_seqs" (int $v.engine.maxNumSeqs)
  "max_queued_requests" (int $v.serve.maxQueuedRequests)
  "request_timeout_s" $v.serve.requestTimeoutS
  "deployment_name" $v.serve.deploymentName
  "num_cpus" $v.serve.numCpus
  "num_gpus" (include "keyserve.replicaGpus" . | float64)
}}
{{- with $v.model.servedModelName }}
{{- $_ := set $args "served_model_name" . }}
{{- end }}
{{- with $v.model.draft }}
{{- $_ := set $args "draft" . }}
{{- $_ := set $args "num_speculative_tokens" (int $v.model.numSpeculativeTokens) }}
{{- end }}
{{- if not (kindIs "invalid" $v.kv.defaultBudget) }}
{{- $_ := set $args "default_kv_budget" $v.kv.defaultBudget }}
{{- end }}
{{- if not (kindIs "invalid" $v.kv.numBlocks) }}
{{- $_ := set $args "num_blocks" (int $v.kv.numBlocks) }}
{{- end }}
{{- if not (kindIs "invalid" $v.engine.numSchedulerSteps) }}
{{- $_ := set $args "num_scheduler_steps" (int $v.engine.numSchedulerSteps) }}
{{- end }}
{{- range $key := list "api_key" "deployment_name" }}
{{- if hasKey ($v.serve.extraArgs | default dict) $key }}
{{- fail (printf "serve.extraArgs.%s is not allowed: %s" $key (ternary "set apiKey instead (a Secret; the key never appears in serveConfigV2)" "set serve.deploymentName instead (the deployment's settings use that name)" (eq $key "api_key"))) }}
{{- end }}
{{- end }}
{{- toYaml (mergeOverwrite $args (deepCopy ($v.serve.extraArgs | default dict))) }}
{{- end }}

{{/* GPUs each Serve replica reserves: serve.numGpus, else 0 -- the replica runs the Ray
     engine's front at every tensor-parallel size, and its target shards reserve their own. */}}
{{- define "keyserve.replicaGpus" -}}
{{- $v := .Values }}
{{- if not (kindIs "invalid" $v.serve.numGpus) }}{{ $v.serve.numGpus }}
{{- else }}0
{{- end }}
{{- end }}

{{/* The Serve deployment settings that belong to Ray Serve: replicas or autoscaling, and
     concurrency when set (else build_app's own default stands). */}}
{{- define "keyserve.serveDeployment" -}}
{{- $s := .Values.serve }}
{{- $d := dict "name" $s.deploymentName }}
{{- if not (kindIs "invalid" $s.maxOngoingRequests) }}
{{- $_ := set $d "max_ongoing_requests" (int $s.maxOngoingRequests) }}
{{- end }}
{{- if $s.autoscaling.enabled }}
{{- $a := $s.autoscaling }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail (printf "serve.autoscaling.minReplicas (%d) must not exceed serve.autoscaling.maxReplicas (%d)" (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
{{- $_ := set $d "num_replicas" "auto" }}
{{- $_ := set $d "autoscaling_config" (dict
  "min_replicas" (int $a.minReplicas)
  "max_replicas" (int $a.maxReplicas)
  "target_ongoing_requests" $a.targetOngoingRequests
  "upscale_delay_s" $a.upscaleDelayS
  "downscale_delay_s" $a.downscaleDelayS) }}
{{- else }}
{{- $_ := set $d "num_replicas" (int $s.numReplicas) }}
{{- end }}
{{- toYaml $d }}
{{- end }}

{{/* The whole Serve config. */}}
{{- define "keyserve.serveConfig" -}}
{{- $s := .Values.serve }}
{{- $app := dict
  "name" $s.applicationName
  "route_prefix" $s.routePrefix
  "import_path" "keyserve.cluster.serve_app:build_app"
  "args" (fromYaml (include "keyserve.serveArgs" .))
  "deployments" (list (fromYaml (include "keyserve.serveDeployment" .)))
}}
{{- $config := dict
  "proxy_location" "EveryNode"
  "http_options" (dict "host" "0.0.0.0" "port" (int $s.port))
  "applications" (list $app)
}}
{{- toYaml $config }}
{{- end }}
