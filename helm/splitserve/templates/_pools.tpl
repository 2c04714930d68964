{{/* Pool sizes: from total + ratio, or explicit; the planner's bounds; the config's floor. */}}

{{/* The values of one model's pool: pools.<id>, else defaultPool. */}}
{{- define "splitserve.pool" -}}
{{- $pool := index (.root.Values.pools | default dict) .id | default .root.Values.defaultPool -}}
{{- if not $pool -}}
{{- fail (printf "pools.%s: missing and no defaultPool; give total + ratio, or prefill + decode" .id) -}}
{{- end -}}
{{- toYaml $pool -}}
{{- end -}}

{{/*
Replica counts of one model as YAML {prefill, decode}. From `total` and `ratio` "a:b":
prefill = total * a / (a + b) rounded half up, kept within [1, total - 1] so that both
pools exist; decode takes the rest. values.schema.json has already checked the shapes.
*/}}
{{- define "splitserve.poolCounts" -}}
{{- $pool := include "splitserve.pool" . | fromYaml -}}
{{- if hasKey $pool "ratio" -}}
{{- $parts := splitList ":" $pool.ratio -}}
{{- $a := index $parts 0 | atoi -}}
{{- $b := index $parts 1 | atoi -}}
{{- $total := int $pool.total -}}
{{- $prefill := div (add (mul 2 $total $a) $a $b) (mul 2 (add $a $b)) -}}
{{- $prefill = max 1 (min $prefill (sub $total 1)) -}}
prefill: {{ $prefill }}
decode: {{ sub $total $prefill }}
{{- else -}}
prefill: {{ int $pool.prefill }}
decode: {{ int $pool.decode }}
{{- end -}}
{{- end -}}

{{/* The planner's bounds for one model: pools.<id>.planner over planner. */}}
{{- define "splitserve.plannerBounds" -}}
{{- $pool := include "splitserve.pool" . | fromYaml -}}
{{- $own := $pool.planner | default dict -}}
{{- $min := merge (deepCopy ($own.min | default dict)) .root.Values.planner.min -}}
{{- $max := merge (deepCopy ($own.max | default dict)) .root.Values.planner.max -}}
{{- range $role := list "prefill" "decode" -}}
{{- if gt (int (index $min $role)) (int (index $max $role)) -}}
{{- fail (printf "pools.%s.planner: min.%s (%v) exceeds max.%s (%v)" $.id $role (index $min $role) $role (index $max $role)) -}}
{{- end -}}
{{- end -}}
min:
  prefill: {{ int $min.prefill }}
  decode: {{ int $min.decode }}
max:
  prefill: {{ int $max.prefill }}
  decode: {{ int $max.decode }}
{{- end -}}

{{/*
The replica count a pool's Deployment is given. With the planner on, an upgrade keeps the
count the planner set (read from the cluster) instead of resetting it to the values.
*/}}
{{- define "splitserve.poolReplicas" -}}
{{- $counts := include "splitserve.poolCounts" . | fromYaml -}}
{{- $replicas := int (index $counts .role) -}}
{{- if .root.Values.planner.enabled -}}
{{- $live := lookup "apps/v1" "Deployment" .root.Release.Namespace (include "splitserve.poolName" .) -}}
{{- if and $live $live.spec $live.spec.replicas -}}
{{- $replicas = int $live.spec.replicas -}}
{{- end -}}
{{- end -}}
{{- $replicas -}}
{{- end -}}

{{/*
The pools written into config.yaml. The coordinator reports ready once that many replicas
of each role have registered, so this is a floor, not the live size: the values' counts, or
the planner's minimum when the planner moves the sizes.
*/}}
{{- define "splitserve.configPools" -}}
{{- if .root.Values.planner.enabled -}}
{{- $bounds := include "splitserve.plannerBounds" . | fromYaml -}}
prefill: {{ max 1 (int $bounds.min.prefill) }}
decode: {{ max 1 (int $bounds.min.decode) }}
both: 0
{{- else -}}
{{- include "splitserve.poolCounts" . }}
both: 0
{{- end -}}
{{- end -}}

{{/* One pool's pod settings: pools.<id>.overrides.<role> over the `workers` defaults. */}}
{{- define "splitserve.workerPod" -}}
{{- $pool := include "splitserve.pool" . | fromYaml -}}
{{- $over := index ($pool.overrides | default dict) .role | default dict -}}
{{- $w := .root.Values.workers -}}
gpus: {{ hasKey $over "gpus" | ternary $over.gpus $w.gpus | int }}
resources:
  {{- mergeOverwrite (deepCopy ($w.resources | default dict)) ($over.resources | default dict) | toYaml | nindent 2 }}
nodeSelector:
  {{- mergeOverwrite (deepCopy ($w.nodeSelector | default dict)) ($over.nodeSelector | default dict) | toYaml | nindent 2 }}
tolerations:
  {{- (hasKey $over "tolerations" | ternary $over.tolerations $w.tolerations) | default list | toYaml | nindent 2 }}
affinity:
  {{- (hasKey $over "affinity" | ternary $over.affinity $w.affinity) | default dict | toYaml | nindent 2 }}
podAnnotations:
  {{- mergeOverwrite (deepCopy ($w.podAnnotations | default dict)) ($over.podAnnotations | default dict) | toYaml | nindent 2 }}
{{- end -}}
