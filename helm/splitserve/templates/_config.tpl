{{/*
config.yaml: the deployment config in exactly the schema `splitserve up` reads
(shared/config/schema.py). It is the cluster's view: coordinator.host is the coordinator
Service's DNS name, the address workers dial to register. Each pod passes the address it
binds itself with --host (its pod IP for workers, 0.0.0.0 for the coordinator).
*/}}
{{- define "splitserve.config" -}}
{{- $root := . -}}
{{- $ids := list -}}
{{- $slugs := dict -}}
{{- $models := list -}}
{{- range $i, $m := .Values.models -}}
{{- $slug := include "splitserve.modelSlug" $m.id -}}
{{- if hasKey $slugs $slug -}}
{{- fail (printf "models[%d].id: %q and %q both name their Kubernetes objects %q; ids must differ in letters or digits" $i (get $slugs $slug) $m.id $slug) -}}
{{- end -}}
{{- $_ := set $slugs $slug $m.id -}}
{{- $ids = append $ids $m.id -}}
{{- $entry := dict "id" $m.id "weights" ($m.weights | default "auto") -}}
{{- with $m.path }}{{ $_ := set $entry "path" . }}{{ end -}}
{{- with $m.max_model_len }}{{ $_ := set $entry "max_model_len" (int .) }}{{ end -}}
{{- $_ := set $entry "pools" (include "splitserve.configPools" (dict "root" $root "id" $m.id) | fromYaml) -}}
{{- with $m.worker }}{{ $_ := set $entry "worker" . }}{{ end -}}
{{- $models = append $models $entry -}}
{{- end -}}
{{- range $id, $_ := .Values.pools -}}
{{- if not (has $id $ids) -}}
{{- fail (printf "pools.%s: no model with that id in models (ids: %s)" $id (join ", " $ids)) -}}
{{- end -}}
{{- end -}}
{{- $coordinator := deepCopy (.Values.coordinator.settings | default dict) -}}
{{- $_ := set $coordinator "host" (include "splitserve.coordinatorHost" .) -}}
{{- $_ := set $coordinator "port" (int .Values.coordinator.port) -}}
{{- $_ := set $coordinator "registry_port" (int .Values.coordinator.registryPort) -}}
{{- $config := dict
  "block_size" (int .Values.config.block_size)
  "models" $models
  "transfer" .Values.config.transfer
  "coordinator" $coordinator
  "worker_host" "0.0.0.0"
  "worker_drain_grace_s" (int .Values.workers.drainGraceSeconds)
-}}
{{- $w := .Values.workers -}}
{{- /* After the drain grace the worker hands its open streams over and stops its server:
two tails of 2 s (DRAIN_TAIL_S in services/worker_server/server.py), then it exits. */ -}}
{{- $podGrace := add (int $w.preStopSleepSeconds) (int $w.drainGraceSeconds) 5 -}}
{{- if lt (int $w.terminationGracePeriodSeconds) (int $podGrace) -}}
{{- fail (printf "workers.terminationGracePeriodSeconds (%d) must be at least preStopSleepSeconds + drainGraceSeconds + 5 (%d): Kubernetes would kill a worker mid-drain" (int $w.terminationGracePeriodSeconds) (int $podGrace)) -}}
{{- end -}}
{{- if .Values.apiKeys.enabled -}}
{{- if .Values.apiKeys.entitlements -}}
{{- if not .Values.apiKeys.existingSecret -}}
{{- fail "apiKeys.entitlements needs apiKeys.existingSecret: a Secret you create holding the YAML key entries (the chart only generates plain one-key-per-line Secrets)" -}}
{{- end -}}
{{- $_ := set $config "api_keys" (dict "file" "/etc/splitserve-secrets/api-keys") -}}
{{- else -}}
{{- $_ := set $coordinator "api_keys_file" "/etc/splitserve-secrets/api-keys" -}}
{{- end -}}
{{- end -}}
{{- if .Values.internalAuth.enabled -}}
{{- $_ := set $config "internal_auth" (dict "token_file" (include "splitserve.internalTokenPath" .)) -}}
{{- end -}}
{{- range $key := list "telemetry" "router" "tiers" "prices" "routers" "playground" -}}
{{- with get $root.Values.config $key }}{{ $_ := set $config $key . }}{{ end -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}
