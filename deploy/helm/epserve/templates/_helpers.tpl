{{/*
Names, labels, addresses and the pieces every pod shares. The command-line flags
of each role are in _args.tpl.
*/}}

{{- define "epserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-epserve, or the release name when it already contains the chart name. */}}
{{- define "epserve.fullname" -}}
{{- include "epserve.removedValues" . }}
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

{{- define "epserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "epserve.clusterName" -}}
{{- default .Release.Name .Values.clusterName }}
{{- end }}

{{/* Object names of each component. */}}
{{- define "epserve.coordinator.fullname" -}}{{ include "epserve.fullname" . }}-coordinator{{- end }}
{{- define "epserve.expertWorker.fullname" -}}{{ include "epserve.fullname" . }}-expert-worker{{- end }}
{{- define "epserve.attentionWorker.fullname" -}}{{ include "epserve.fullname" . }}-attention-worker{{- end }}
{{- define "epserve.etcd.fullname" -}}{{ include "epserve.fullname" . }}-etcd{{- end }}

{{/* Labels selecting the pods of one component: include with (dict "ctx" $ "component" "coordinator"). */}}
{{- define "epserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "epserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Every label of one component's objects. */}}
{{- define "epserve.labels" -}}
helm.sh/chart: {{ include "epserve.chart" .ctx }}
{{ include "epserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: epserve
{{- end }}

{{- define "epserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "epserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "epserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* --etcd: the chart's client Service, or the external endpoints joined by commas. */}}
{{- define "epserve.etcdEndpoints" -}}
{{- if .Values.etcd.enabled }}
{{- printf "%s://%s.%s.svc.%s:%v" (ternary "https" "http" (and .Values.tls.enabled true)) (include "epserve.etcd.fullname" .) .Release.Namespace .Values.clusterDomain .Values.etcd.clientPort }}
{{- else }}
{{- if not .Values.etcd.external.endpoints }}
{{- fail "etcd.enabled is false: set etcd.external.endpoints to the client URLs of your etcd" }}
{{- end }}
{{- if .Values.etcd.external.tls.existingSecret }}
{{- range .Values.etcd.external.endpoints }}
{{- if hasPrefix "http://" . }}
{{- fail (printf "etcd.external.endpoints: %s is plain http but etcd.external.tls.existingSecret is set: use https://" .) }}
{{- end }}
{{- end }}
{{- end }}
{{- join "," .Values.etcd.external.endpoints }}
{{- end }}
{{- end }}

{{/* Headless Service DNS name of a StatefulSet: include with (dict "ctx" $ "name" <statefulset name>). */}}
{{- define "epserve.headlessDomain" -}}
{{- printf "%s.%s.svc.%s" .name .ctx.Release.Namespace .ctx.Values.clusterDomain }}
{{- end }}

{{/* Secret names and keys. */}}
{{- define "epserve.apiKeySecretName" -}}
{{- default (printf "%s-api-key" (include "epserve.fullname" .)) .Values.auth.apiKey.existingSecret }}
{{- end }}
{{- define "epserve.adminTokenSecretName" -}}
{{- default (printf "%s-admin-token" (include "epserve.fullname" .)) .Values.auth.adminToken.existingSecret }}
{{- end }}

{{/*
TLS (tls.enabled). Each role has its own certificate, mounted at tls.mountPath
(tls.crt, tls.key, ca.crt): from cert-manager ("<component fullname>-tls") or an
existing Secret. include "epserve.tls.secretName" (dict "ctx" $ "role" "expertWorker")
with role one of coordinator, expertWorker, attentionWorker, etcd, client.
*/}}
{{- define "epserve.tls.component" -}}
{{- get (dict "coordinator" "coordinator" "expertWorker" "expert-worker" "attentionWorker" "attention-worker" "etcd" "etcd" "client" "client") .role | required (printf "unknown TLS role %s" .role) }}
{{- end }}

{{- define "epserve.tls.secretName" -}}
{{- $t := .ctx.Values.tls }}
{{- if $t.certManager.enabled }}
{{- printf "%s-%s-tls" (include "epserve.fullname" .ctx) (include "epserve.tls.component" .) }}
{{- else }}
{{- $name := (index $t.existingSecrets .role) | default $t.existingSecret }}
{{- if not $name }}
{{- fail (printf "tls.enabled needs certificates: set tls.certManager.enabled=true, or tls.existingSecret (or tls.existingSecrets.%s) to a Secret with tls.crt, tls.key and ca.crt" .role) }}
{{- end }}
{{- $name }}
{{- end }}
{{- end }}

{{/* The Secret of the OpenAI port's HTTPS certificate (tls.api). */}}
{{- define "epserve.tls.apiSecretName" -}}
{{- $t := .Values.tls }}
{{- if $t.api.existingSecret }}
{{- $t.api.existingSecret }}
{{- else if $t.certManager.enabled }}
{{- printf "%s-api-tls" (include "epserve.coordinator.fullname" .) }}
{{- else }}
{{- include "epserve.tls.secretName" (dict "ctx" . "role" "coordinator") }}
{{- end }}
{{- end }}

{{/* HTTPS on the OpenAI port: tls.enabled and tls.api.enabled. */}}
{{- define "epserve.tls.api" -}}
{{- if and .Values.tls.enabled .Values.tls.api.enabled }}true{{ end }}
{{- end }}

{{/* Mount paths of the API certificate, an external etcd's TLS material and its password. */}}
{{- define "epserve.tls.apiMountPath" -}}{{ trimSuffix "/" .Values.tls.mountPath }}-api{{- end }}
{{- define "epserve.etcdTlsMountPath" -}}/etc/epserve/etcd-tls{{- end }}
{{- define "epserve.etcdAuthMountPath" -}}/etc/epserve/etcd-auth{{- end }}

{{/*
How the epserve roles reach etcd securely, as (tls ca cert) paths or empty:
the chart's etcd with tls.enabled (each role's own certificate, client-cert auth),
or an external etcd with etcd.external.tls.existingSecret.
*/}}
{{- define "epserve.etcdTlsDir" -}}
{{- if and .Values.etcd.enabled .Values.tls.enabled }}
{{- trimSuffix "/" .Values.tls.mountPath }}
{{- else if and (not .Values.etcd.enabled) .Values.etcd.external.tls.existingSecret }}
{{- include "epserve.etcdTlsMountPath" . }}
{{- end }}
{{- end }}

{{/*
Volumes with an epserve role's TLS and etcd credentials: include with
(dict "ctx" $ "role" "expertWorker"). Secret files are readable by the pod's group only.
*/}}
{{- define "epserve.securityVolumes" -}}
{{- $ctx := .ctx }}
{{- if $ctx.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "epserve.tls.secretName" . }}
    defaultMode: 288  # 0440
{{- if and (eq .role "coordinator") (include "epserve.tls.api" $ctx) }}
- name: api-tls
  secret:
    secretName: {{ include "epserve.tls.apiSecretName" $ctx }}
    defaultMode: 288  # 0440
{{- end }}
{{- end }}
{{- if ne .role "client" }}
{{- if and (not $ctx.Values.etcd.enabled) $ctx.Values.etcd.external.tls.existingSecret }}
- name: etcd-tls
  secret:
    secretName: {{ $ctx.Values.etcd.external.tls.existingSecret }}
    defaultMode: 288  # 0440
{{- end }}
{{- if and (not $ctx.Values.etcd.enabled) $ctx.Values.etcd.external.auth.user }}
- name: etcd-auth
  secret:
    secretName: {{ required "etcd.external.auth.existingSecret (the etcd password) is required with etcd.external.auth.user" $ctx.Values.etcd.external.auth.existingSecret }}
    defaultMode: 288  # 0440
    items:
      - key: {{ $ctx.Values.etcd.external.auth.secretKey }}
        path: password
{{- end }}
{{- end }}
{{- end }}

{{- define "epserve.securityVolumeMounts" -}}
{{- $ctx := .ctx }}
{{- if $ctx.Values.tls.enabled }}
- name: tls
  mountPath: {{ $ctx.Values.tls.mountPath }}
  readOnly: true
{{- if and (eq .role "coordinator") (include "epserve.tls.api" $ctx) }}
- name: api-tls
  mountPath: {{ include "epserve.tls.apiMountPath" $ctx }}
  readOnly: true
{{- end }}
{{- end }}
{{- if ne .role "client" }}
{{- if and (not $ctx.Values.etcd.enabled) $ctx.Values.etcd.external.tls.existingSecret }}
- name: etcd-tls
  mountPath: {{ include "epserve.etcdTlsMountPath" $ctx }}
  readOnly: true
{{- end }}
{{- if and (not $ctx.Values.etcd.enabled) $ctx.Values.etcd.external.auth.user }}
- name: etcd-auth
  mountPath: {{ include "epserve.etcdAuthMountPath" $ctx }}
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{/*
Values that were removed: fail instead of silently ignoring them.
*/}}
{{- define "epserve.removedValues" -}}
{{- if hasKey .Values.metrics "workerPort" }}
{{- fail "metrics.workerPort was removed: expert- and attention-workers serve no /metrics (the coordinator serves it on its OpenAI port)" }}
{{- end }}
{{- range $k := list "cert" "key" "ca" "existingSecretHasCa" }}
{{- if hasKey $.Values.tls $k }}
{{- fail (printf "tls.%s was removed: give each role a Secret with tls.crt, tls.key and ca.crt (tls.existingSecret / tls.existingSecrets) or use tls.certManager" $k) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The model folder passed as --model. */}}
{{- define "epserve.modelDir" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.path) }}
{{- end }}

{{/*
Guaranteed-QoS resources: requests == limits from {cpu, memory}; cpu must be a whole
number so the static CPU manager gives the container exclusive cores.
include with (dict "res" .Values.x.resources "what" "x.resources")
*/}}
{{- define "epserve.guaranteedResources" -}}
{{- $cpu := required (printf "%s.cpu is required" .what) .res.cpu }}
{{- $mem := required (printf "%s.memory is required" .what) .res.memory }}
{{- if or (ne (toString $cpu) (toString (int $cpu))) (lt (int $cpu) 1) }}
{{- fail (printf "%s.cpu must be a whole number of CPUs (got %v) for Guaranteed QoS with exclusive cores" .what $cpu) }}
{{- end }}
requests:
  cpu: {{ int $cpu | quote }}
  memory: {{ $mem | quote }}
limits:
  cpu: {{ int $cpu | quote }}
  memory: {{ $mem | quote }}
{{- end }}

{{/*
Node affinity (arch via nodeSelector elsewhere; instance families here), zone affinity
towards the coordinator, and anti-affinity between pods of the same component.
include with (dict "ctx" $ "component" "expert-worker" "families" list "sizes" list "antiAffinity" "soft")
Empty families / sizes fall back to scheduling.instanceFamilies / instanceSizes, except
that with "own" true (etcd) empty families mean no instance-type constraint at all (any
node of the architecture, e.g. a small system node group).
*/}}
{{- define "epserve.affinity" -}}
{{- $ctx := .ctx }}
{{- $s := $ctx.Values.scheduling }}
{{- $families := .families | default (ternary list $s.instanceFamilies (.own | default false)) }}
{{- $sizes := .sizes | default $s.instanceSizes }}
{{- $terms := list }}
{{- if and $families (ne $s.nodeAffinity "none") }}
{{- if $s.instanceFamilyLabel }}
{{- $terms = append $terms (dict "key" $s.instanceFamilyLabel "operator" "In" "values" $families) }}
{{- else }}
{{- $types := list }}
{{- range $f := $families }}
{{- range $z := $sizes }}
{{- $types = append $types (printf "%s.%s" $f $z) }}
{{- end }}
{{- end }}
{{- $terms = append $terms (dict "key" "node.kubernetes.io/instance-type" "operator" "In" "values" $types) }}
{{- end }}
{{- end }}
{{- $zone := and $s.sameZone (ne .component "coordinator") }}
{{- $anti := .antiAffinity | default "none" }}
{{- if or $terms $zone (ne $anti "none") }}
{{- if $terms }}
nodeAffinity:
  {{- if eq $s.nodeAffinity "required" }}
  requiredDuringSchedulingIgnoredDuringExecution:
    nodeSelectorTerms:
      - matchExpressions:
          {{- toYaml $terms | nindent 10 }}
  {{- else if eq $s.nodeAffinity "preferred" }}
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      preference:
        matchExpressions:
          {{- toYaml $terms | nindent 10 }}
  {{- else }}
  {{- fail (printf "scheduling.nodeAffinity must be required, preferred or none (got %s)" $s.nodeAffinity) }}
  {{- end }}
{{- end }}
{{- if $zone }}
podAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: topology.kubernetes.io/zone
        labelSelector:
          matchLabels:
            {{- include "epserve.selectorLabels" (dict "ctx" $ctx "component" "coordinator") | nindent 12 }}
{{- end }}
{{- if eq $anti "hard" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "epserve.selectorLabels" (dict "ctx" $ctx "component" .component) | nindent 10 }}
{{- else if eq $anti "soft" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "epserve.selectorLabels" (dict "ctx" $ctx "component" .component) | nindent 12 }}
{{- else if ne $anti "none" }}
{{- fail (printf "antiAffinity must be hard, soft or none (got %s)" $anti) }}
{{- end }}
{{- end }}
{{- end }}

{{/* nodeSelector: arch + the role's extra entries. include with (dict "ctx" $ "extra" .Values.x.nodeSelector) */}}
{{- define "epserve.nodeSelector" -}}
{{- $sel := dict "kubernetes.io/arch" .ctx.Values.scheduling.arch }}
{{- $sel = merge (deepCopy (.extra | default dict)) $sel }}
{{- toYaml $sel }}
{{- end }}

{{/* Tolerations: shared + the role's. */}}
{{- define "epserve.tolerations" -}}
{{- $t := concat (.ctx.Values.scheduling.tolerations | default list) (.extra | default list) }}
{{- if $t }}
{{- toYaml $t }}
{{- end }}
{{- end }}

{{/* Environment every epserve container gets. */}}
{{- define "epserve.commonEnv" -}}
- name: EPSERVE_LOG
  value: {{ .Values.logLevel | quote }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}

{{/* Prometheus scrape annotations: include with (dict "ctx" $ "port" 8000). */}}
{{- define "epserve.scrapeAnnotations" -}}
{{- if .ctx.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- if .https }}
prometheus.io/scheme: https
{{- end }}
{{- end }}
{{- end }}

{{/* Volumes for the model (and TLS, /tmp). */}}
{{- define "epserve.volumes" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- else if eq .Values.model.source "s3" }}
{{- if eq .Values.model.s3.cache.type "hostPath" }}
  hostPath:
    path: {{ .Values.model.s3.cache.hostPath }}
    type: DirectoryOrCreate
{{- else if eq .Values.model.s3.cache.type "emptyDir" }}
  emptyDir:
    sizeLimit: {{ .Values.model.s3.cache.sizeLimit }}
{{- else }}
{{- fail (printf "model.s3.cache.type must be hostPath or emptyDir (got %s)" .Values.model.s3.cache.type) }}
{{- end }}
{{- else }}
{{- fail (printf "model.source must be pvc, hostPath or s3 (got %s)" .Values.model.source) }}
{{- end }}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "epserve.volumeMounts" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end }}

{{/*
Init container copying the model from S3 into the cache volume, once: a finished copy
carries a marker naming its source and is skipped; copies go to a private folder first
and are renamed into place, so concurrent pods on one node never see half a model.
*/}}
{{- define "epserve.modelInitContainers" -}}
{{- if eq .Values.model.source "s3" }}
- name: fetch-model
  image: "{{ .Values.model.s3.image.repository }}:{{ .Values.model.s3.image.tag }}"
  imagePullPolicy: {{ .Values.model.s3.image.pullPolicy }}
  command: ["/bin/sh", "-c"]
  args:
    - |
      set -eu
      dest="/cache/${MODEL_PATH}"
      marker="${dest}/.epserve-source"
      if [ -f "${marker}" ] && [ "$(cat "${marker}")" = "${MODEL_URI}" ]; then
        echo "model ${MODEL_URI} already in ${dest}"; exit 0
      fi
      tmp="/cache/.partial-${POD_NAME}"
      rm -rf "${tmp}" && mkdir -p "${tmp}" "$(dirname "${dest}")"
      echo "copying ${MODEL_URI} to ${dest}"
      aws s3 sync --only-show-errors "${MODEL_URI}" "${tmp}" "$@"
      test -f "${tmp}/config.json" || { echo "error: no config.json under ${MODEL_URI}" >&2; exit 1; }
      printf '%s' "${MODEL_URI}" > "${tmp}/.epserve-source"
      if [ -f "${marker}" ] && [ "$(cat "${marker}")" = "${MODEL_URI}" ]; then rm -rf "${tmp}"; exit 0; fi
      rm -rf "${dest}.old"
      if [ -e "${dest}" ]; then mv "${dest}" "${dest}.old"; fi
      mv "${tmp}" "${dest}" && rm -rf "${dest}.old"
    - fetch-model
    {{- range .Values.model.s3.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: MODEL_URI
      value: {{ required "model.s3.uri is required when model.source is s3" .Values.model.s3.uri | quote }}
    - name: MODEL_PATH
      value: {{ trimPrefix "/" .Values.model.path | quote }}
    - name: HOME
      value: /tmp
    - name: POD_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    {{- with .Values.model.s3.region }}
    - name: AWS_REGION
      value: {{ . | quote }}
    {{- end }}
  resources:
    {{- include "epserve.guaranteedResources" (dict "res" .Values.model.s3.resources "what" "model.s3.resources") | trim | nindent 4 }}
  securityContext:
    {{- toYaml .Values.model.s3.securityContext | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: /cache
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* Environment of a secret-backed variable: include with (dict "name" "EPSERVE_API_KEY" "secret" <name> "key" <key>). */}}
{{- define "epserve.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .secret }}
      key: {{ .key }}
{{- end }}

{{/* Pod-level security context, service account, pull secrets. */}}
{{- define "epserve.podCommon" -}}
serviceAccountName: {{ include "epserve.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/*
A worker's probe from values: a `grpc:` action (Kubernetes' native gRPC probe
on grpc.health.v1.Health) gets the worker's port when it names none (the
probe's port must be a number). Args: probe (the values dict), port.
*/}}
{{- define "epserve.workerProbe" -}}
{{- $p := deepCopy .probe -}}
{{- if and (hasKey $p "grpc") .tls -}}
{{- /* The kubelet's gRPC probe speaks plaintext and has no client certificate: with
mutual TLS on the port it could never pass, so it becomes a TCP probe. */ -}}
{{- $_ := unset $p "grpc" -}}
{{- $_ := set $p "tcpSocket" (dict "port" "grpc") -}}
{{- else if hasKey $p "grpc" -}}
{{- $_ := set $p "grpc" (merge (deepCopy ($p.grpc | default dict)) (dict "port" (int .port))) -}}
{{- end -}}
{{- toYaml $p -}}
{{- end }}

{{/*
The coordinator's HTTP probes: scheme HTTPS when the OpenAI port serves TLS (the
kubelet does not verify the certificate). Args: probe, https.
*/}}
{{- define "epserve.httpProbe" -}}
{{- $p := deepCopy .probe -}}
{{- if and (hasKey $p "httpGet") .https (not (hasKey $p.httpGet "scheme")) -}}
{{- $_ := set $p "httpGet" (merge (deepCopy $p.httpGet) (dict "scheme" "HTTPS")) -}}
{{- end -}}
{{- toYaml $p -}}
{{- end }}
