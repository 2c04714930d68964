{{/* Names, labels and the image: shared by every template. */}}

{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* 32 characters at most: a pool is named <fullname>-<model slug (22)>-prefill, and
     Service names must fit a 63-character DNS label. */}}
{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 32 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 32 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 32 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels; call with (dict "root" $ "component" "coordinator" ["model" slug]). */}}
{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- with .model }}
splitserve.io/model: {{ . }}
{{- end }}
{{- end -}}

{{- define "splitserve.labels" -}}
helm.sh/chart: {{ include "splitserve.chart" .root }}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: splitserve
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels of an object that belongs to the release as a whole. */}}
{{- define "splitserve.releaseLabels" -}}
{{ include "splitserve.labels" (dict "root" . "component" "release") }}
{{- end -}}

{{- define "splitserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "splitserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.coordinatorName" -}}
{{- printf "%s-coordinator" (include "splitserve.fullname" .) -}}
{{- end -}}

{{- define "splitserve.plannerName" -}}
{{- printf "%s-planner" (include "splitserve.fullname" .) -}}
{{- end -}}

{{- define "splitserve.internalTokenSecretName" -}}
{{- .Values.internalAuth.existingSecret | default (printf "%s-internal-token" (include "splitserve.fullname" .)) -}}
{{- end -}}

{{/* Where every pod finds the internal token (config.yaml's internal_auth.token_file). */}}
{{- define "splitserve.internalTokenPath" -}}
/etc/splitserve-internal/token
{{- end -}}

{{/* Internal TLS: the Secret holding ca.crt, tls.crt and tls.key (yours, or the one
     cert-manager writes), the name every certificate carries, where pods mount it. */}}
{{- define "splitserve.internalTlsSecretName" -}}
{{- .Values.internalAuth.tls.existingSecret | default (printf "%s-internal-tls" (include "splitserve.fullname" .)) -}}
{{- end -}}

{{- define "splitserve.internalTlsServerName" -}}
{{- .Values.internalAuth.tls.serverName | default (printf "%s-internal" (include "splitserve.fullname" .)) -}}
{{- end -}}

{{- define "splitserve.internalTlsDir" -}}
/etc/splitserve-tls
{{- end -}}

{{- define "splitserve.apiKeysSecretName" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "splitserve.fullname" .)) -}}
{{- end -}}

{{/* Where workers reach the coordinator's registry (config.yaml's coordinator.host). */}}
{{- define "splitserve.coordinatorHost" -}}
{{- printf "%s-registry.%s.svc" (include "splitserve.coordinatorName" .) .Release.Namespace -}}
{{- end -}}

{{/* Where the planner and `helm test` reach the coordinator's HTTP API. */}}
{{- define "splitserve.coordinatorURL" -}}
{{- printf "http://%s.%s.svc:%d" (include "splitserve.coordinatorName" .) .Release.Namespace (int .Values.coordinator.service.port) -}}
{{- end -}}

{{/* A model id as a DNS label: lower case, runs of anything else become one "-". */}}
{{- define "splitserve.modelSlug" -}}
{{- $slug := regexReplaceAll "[^a-z0-9]+" (lower .) "-" | trimAll "-" | trunc 22 | trimSuffix "-" -}}
{{- if not $slug -}}
{{- fail (printf "models: id %q has no letter or digit to name its Kubernetes objects after" .) -}}
{{- end -}}
{{- $slug -}}
{{- end -}}

{{/* Name of one pool's Deployment and Service; call with (dict "root" $ "id" ID "role" R). */}}
{{- define "splitserve.poolName" -}}
{{- printf "%s-%s-%s" (include "splitserve.fullname" .root) (include "splitserve.modelSlug" .id) .role -}}
{{- end -}}

{{/* Pod-level security and the volumes every splitserve container mounts. */}}
{{- define "splitserve.podSecurity" -}}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "splitserve.commonVolumes" -}}
- name: config
  configMap:
    name: {{ include "splitserve.fullname" . }}-config
- name: tmp
  emptyDir: {}
{{- if .Values.internalAuth.enabled }}
- name: internal-token
  secret:
    secretName: {{ include "splitserve.internalTokenSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.internalAuth.secretKey }}
        path: token
{{- end }}
{{- if .Values.internalAuth.tls.enabled }}
- name: internal-tls
  secret:
    secretName: {{ include "splitserve.internalTlsSecretName" . }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- with .Values.modelStorage.volume }}
- name: models
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "splitserve.commonMounts" -}}
- name: config
  mountPath: /etc/splitserve
  readOnly: true
# The root filesystem is read-only: scratch files, caches and HOME live here.
- name: tmp
  mountPath: /tmp
{{- if .Values.internalAuth.enabled }}
- name: internal-token
  mountPath: {{ include "splitserve.internalTokenPath" . | dir }}
  readOnly: true
{{- end }}
{{- if .Values.internalAuth.tls.enabled }}
- name: internal-tls
  mountPath: {{ include "splitserve.internalTlsDir" . }}
  readOnly: true
{{- end }}
{{- if .Values.modelStorage.volume }}
- name: models
  mountPath: {{ .Values.modelStorage.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "splitserve.commonEnv" -}}
- name: HOME
  value: /tmp
- name: PYTHONUNBUFFERED
  value: "1"
{{- end -}}

{{/* "true" when trained draft heads come from the drafts volume, empty otherwise. */}}
{{- define "splitserve.draftsOnVolume" -}}
{{- if .Values.draftTraining.drafts.volume }}true{{ end -}}
{{- end -}}

{{/* The head file a model's decode pods watch and its adaptation job replaces; call with
(dict "root" $ "id" ID). */}}
{{- define "splitserve.servedDraftPath" -}}
{{- printf "%s/%s.head.pt" .root.Values.draftTraining.drafts.mountPath (include "splitserve.modelSlug" .id) -}}
{{- end -}}

{{/* The ids of the models whose decode pods draft with a head from the drafts volume (method
draft or adaptive, no draft_path of their own), as a JSON list. */}}
{{- define "splitserve.adaptedModels" -}}
{{- $ids := list -}}
{{- range $m := .Values.models -}}
{{- $spec := $m.speculative | default dict -}}
{{- if and (has ($spec.method | default "") (list "draft" "adaptive")) (not $spec.draft_path) -}}
{{- $ids = append $ids $m.id -}}
{{- end -}}
{{- end -}}
{{- toJson $ids -}}
{{- end -}}
