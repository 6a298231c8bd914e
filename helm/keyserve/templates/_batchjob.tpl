{{/*
The RayJob entrypoint: `python -m keyserve.cluster.batch_job` with the model settings of the
chart; an argument with characters the shell would interpret is single-quoted (`ray job submit`
runs the entrypoint in a shell).
Optional flags appear only when their value is set.
*/}}
{{- define "keyserve.batchArgs" -}}
{{- $v := .Values }}
{{- $args := list "--input" $v.batchJob.input "--output" $v.batchJob.output
  "--model" $v.model.name "--dtype" $v.model.dtype
  "--tp" (toString (int $v.model.tensorParallelSize))
  "--max-num-seqs" (toString (int $v.engine.maxNumSeqs))
  "--default-kv-policy" $v.kv.defaultPolicy }}
{{- with $v.model.draft }}
{{- $args = concat $args (list "--draft" . "--num-speculative-tokens" (toString (int $v.model.numSpeculativeTokens))) }}
{{- end }}
{{- if not (kindIs "invalid" $v.kv.defaultBudget) }}
{{- $args = concat $args (list "--default-kv-budget" (toString $v.kv.defaultBudget)) }}
{{- end }}
{{- if not (kindIs "invalid" $v.kv.numBlocks) }}
{{- $args = concat $args (list "--num-blocks" (toString (int $v.kv.numBlocks))) }}
{{- end }}
{{- if not (kindIs "invalid" $v.engine.numSchedulerSteps) }}
{{- $args = concat $args (list "--num-scheduler-steps" (toString (int $v.engine.numSchedulerSteps))) }}
{{- end }}
{{- range $v.batchJob.extraArgs }}
{{- $args = append $args (toString .) }}
{{- end }}
{{- $quoted := list }}
{{- range $args }}
{{- if regexMatch "^[A-Za-z0-9_./:=@%+,-]+$" . }}
{{- $quoted = append $quoted . }}
{{- else }}
{{- $quoted = append $quoted (printf "'%s'" (replace "'" "'\\''" .)) }}
{{- end }}
{{- end }}
{{- printf "python -m keyserve.cluster.batch_job %s" (join " " $quoted) }}
{{- end }}
