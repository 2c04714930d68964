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
{{- $spec := deepCopy ($m.speculative | default dict) -}}
{{- if and (include "splitserve.draftsOnVolume" $root) (has ($spec.method | default "") (list "draft" "adaptive")) (not $spec.draft_path) -}}
{{- $_ := set $spec "draft_path" (include "splitserve.servedDraftPath" (dict "root" $root "id" $m.id)) -}}
{{- end -}}
{{- with $spec }}{{ $_ := set $entry "speculative" . }}{{ end -}}
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
two tails of 2 s (DRAIN_TAIL_S in services/worker/server.py), then it exits. */ -}}
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
{{- $internal := dict -}}
{{- if .Values.internalAuth.enabled -}}
{{- $_ := set $internal "token_file" (include "splitserve.internalTokenPath" .) -}}
{{- end -}}
{{- $tls := .Values.internalAuth.tls -}}
{{- if $tls.enabled -}}
{{- if not (or $tls.existingSecret $tls.certManager.enabled) -}}
{{- fail "internalAuth.tls.enabled: TLS without certificates. Name a Secret holding ca.crt, tls.crt and tls.key in internalAuth.tls.existingSecret (kubectl create secret generic NAME --from-file=ca.crt --from-file=tls.crt --from-file=tls.key), or set internalAuth.tls.certManager.enabled=true to have cert-manager issue them" -}}
{{- end -}}
{{- if eq (int $tls.healthPort) (int .Values.workers.grpcPort) -}}
{{- fail (printf "internalAuth.tls.healthPort (%d) must differ from workers.grpcPort: it is the plaintext port that serves only grpc.health.v1" (int $tls.healthPort)) -}}
{{- end -}}
{{- $dir := include "splitserve.internalTlsDir" . -}}
{{- $_ := set $internal "tls" (dict
  "enabled" true
  "ca_file" (printf "%s/ca.crt" $dir)
  "cert_file" (printf "%s/tls.crt" $dir)
  "key_file" (printf "%s/tls.key" $dir)
  "server_name" (include "splitserve.internalTlsServerName" .)
  "health_port" (int $tls.healthPort)
) -}}
{{- end -}}
{{- with $internal }}{{ $_ := set $config "internal_auth" . }}{{ end -}}
{{- $dt := .Values.draftTraining -}}
{{- if $dt.log.enabled -}}
{{- if not $dt.log.volume -}}
{{- fail "draftTraining.log.enabled needs draftTraining.log.volume: a log on the coordinator pod's own disk is lost with the pod (and no adaptation job could read it)" -}}
{{- end -}}
{{- $_ := set $config "capture" (dict "training_log" (dict
  "enabled" true
  "path" (printf "%s/{host}.jsonl" $dt.log.mountPath)
  "sample_ratio" $dt.log.sampleRatio
)) -}}
{{- end -}}
{{- if $dt.adaptation.enabled -}}
{{- if not $dt.log.enabled -}}
{{- fail "draftTraining.adaptation.enabled needs draftTraining.log.enabled: adaptation trains on the training log" -}}
{{- end -}}
{{- if not $dt.drafts.volume -}}
{{- fail "draftTraining.adaptation.enabled needs draftTraining.drafts.volume: the heads it trains must reach the decode pods" -}}
{{- end -}}
{{- if not (include "splitserve.adaptedModels" . | fromJsonArray) -}}
{{- fail "draftTraining.adaptation.enabled: no model drafts with a head (set models[].speculative.method to draft or adaptive)" -}}
{{- end -}}
{{- end -}}
{{- range $key := list "telemetry" "router" "tiers" "prices" "routers" "playground" -}}
{{- with get $root.Values.config $key }}{{ $_ := set $config $key . }}{{ end -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}
