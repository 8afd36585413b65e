{{/*
The command line of every epserve role, in one place: when a flag of
`epserve coordinator`, `epserve expert-worker` or `epserve attention-worker`
changes, change it here (deploy/tests/test_chart.py checks these flags against
`epserve <role> --help` of the built binary). Flags are written `--flag=value`.
$(POD_NAME) and friends are expanded by Kubernetes from the container's env.
*/}}

{{/* Flags every role shares: the model, etcd (and how to reach it securely), the cluster's key prefix. */}}
{{- define "epserve.args.common" -}}
- --model={{ include "epserve.modelDir" . }}
{{ include "epserve.args.etcd" . }}
- --cluster={{ include "epserve.clusterName" . }}
{{- end }}

{{/*
etcd: the endpoints, TLS (--etcd-ca: the chart's etcd with tls.enabled, where each
role presents its own certificate for etcd's --client-cert-auth; or an external etcd's
Secret) and user/password auth (an external etcd; the password from a mounted file).
*/}}
{{- define "epserve.args.etcd" -}}
- --etcd={{ include "epserve.etcdEndpoints" . }}
{{- with include "epserve.etcdTlsDir" . }}
- --etcd-ca={{ . }}/ca.crt
{{- if or $.Values.etcd.enabled $.Values.etcd.external.tls.clientCert }}
- --etcd-cert={{ . }}/tls.crt
- --etcd-key={{ . }}/tls.key
{{- end }}
{{- end }}
{{- if and (not .Values.etcd.enabled) .Values.etcd.external.auth.user }}
- --etcd-user={{ .Values.etcd.external.auth.user }}
- --etcd-password-file={{ include "epserve.etcdAuthMountPath" . }}/password
{{- end }}
{{- end }}

{{/*
Mutual TLS of the gRPC node links (tls.enabled): every role's own certificate (its
server and its client identity) and the CA its peers must be signed by.
*/}}
{{- define "epserve.args.tls" -}}
{{- if .Values.tls.enabled }}
- --tls-cert={{ trimSuffix "/" .Values.tls.mountPath }}/tls.crt
- --tls-key={{ trimSuffix "/" .Values.tls.mountPath }}/tls.key
- --tls-ca={{ trimSuffix "/" .Values.tls.mountPath }}/ca.crt
{{- end }}
{{- end }}

{{/* HTTPS on the coordinator's OpenAI port (tls.enabled and tls.api.enabled). */}}
{{- define "epserve.args.apiTls" -}}
{{- if include "epserve.tls.api" . }}
- --api-tls-cert={{ include "epserve.tls.apiMountPath" . }}/tls.crt
- --api-tls-key={{ include "epserve.tls.apiMountPath" . }}/tls.key
{{- end }}
{{- end }}

{{/* epserve coordinator: OpenAI API on --port, admin gRPC on --admin-port. */}}
{{- define "epserve.args.coordinator" -}}
{{- $c := .Values.coordinator -}}
- coordinator
{{ include "epserve.args.common" . }}
- --host=0.0.0.0
- --port={{ $c.port }}
- --admin-port={{ $c.adminPort }}
{{- /* A minimum to start, not the worker set: scaling expertWorkers.replicas must not
change (and so restart) the coordinator; workers that register later get experts. */}}
- --min-expert-workers={{ $c.minExpertWorkers }}
{{- if gt (int .Values.attentionWorkers.replicas) 0 }}
- --attention-workers={{ .Values.attentionWorkers.replicas }}
{{- end }}
{{- range .Values.model.servedModelName }}
- --served-model-name={{ . }}
{{- end }}
{{- with $c.maxModelLen }}
- --max-model-len={{ . }}
{{- end }}
- --max-num-seqs={{ $c.maxNumSeqs }}
- --max-num-batched-tokens={{ $c.maxNumBatchedTokens }}
{{- with $c.kvCacheMemory }}
- --kv-cache-memory={{ . }}
{{- end }}
- --block-size={{ $c.blockSize }}
{{- with $c.kvCacheDtype }}
- --kv-cache-dtype={{ . }}
{{- end }}
{{- with $c.denseDtype }}
- --dense-dtype={{ . }}
{{- end }}
{{- with $c.microBatches }}
- --micro-batches={{ . }}
{{- end }}
{{- with $c.dispatchDtype }}
- --dispatch-dtype={{ . }}
{{- end }}
{{- with $c.expertPrecisionPolicy }}
- --expert-precision-policy={{ . }}
{{- end }}
{{- if ne $c.expertBf16Share nil }}
{{- if ne (toString $c.expertPrecisionPolicy) "load" }}
{{- fail "coordinator.expertBf16Share needs coordinator.expertPrecisionPolicy: load" }}
{{- end }}
- --expert-bf16-share={{ $c.expertBf16Share }}
{{- end }}
- --eplb-window={{ $c.eplb.window }}
{{- if $c.eplb.expertLoadMetrics }}
- --expert-load-metrics
{{- end }}
- --eplb-interval={{ $c.eplb.interval }}
- --eplb-min-improvement={{ $c.eplb.minImprovement }}
- --eplb-redundant-experts={{ $c.eplb.redundantExperts }}
- --rebalance-timeout-secs={{ $c.eplb.rebalanceTimeoutSecs }}
{{- include "epserve.args.tls" . }}
{{- include "epserve.args.apiTls" . }}
{{- range $c.extraArgs }}
- {{ . }}
{{- end }}
{{- end }}

{{/* epserve expert-worker: gRPC ExpertService on --listen, registered in etcd as --advertise. */}}
{{- define "epserve.args.expertWorker" -}}
{{- $w := .Values.expertWorkers -}}
{{- $name := include "epserve.expertWorker.fullname" . -}}
- expert-worker
{{ include "epserve.args.common" . }}
- --listen=0.0.0.0:{{ $w.port }}
{{- if eq $w.advertise "dns" }}
- --advertise=$(POD_NAME).{{ include "epserve.headlessDomain" (dict "ctx" . "name" $name) }}:{{ $w.port }}
{{- else if eq $w.advertise "podIP" }}
{{- if .Values.tls.enabled }}
{{- fail "expertWorkers.advertise must be dns with tls.enabled: the coordinator checks that a worker's certificate names the address it registers in etcd, and a pod IP is not known when the certificate is made" }}
{{- end }}
- --advertise=$(POD_IP):{{ $w.port }}
{{- else }}
{{- fail (printf "expertWorkers.advertise must be dns or podIP (got %s)" $w.advertise) }}
{{- end }}
{{- with $w.cores }}
- --cores={{ . }}
{{- end }}
{{- with $w.expertDtype }}
- --expert-dtype={{ . }}
{{- end }}
{{- with $w.expertMemory }}
- --expert-memory={{ . }}
{{- end }}
- --drain-timeout-secs={{ $w.drainTimeoutSeconds }}
{{- include "epserve.args.tls" . }}
{{- range $w.extraArgs }}
- {{ . }}
{{- end }}
{{- end }}

{{/* epserve attention-worker: shard $(EPSERVE_SHARD) of N (the pod's StatefulSet ordinal). */}}
{{- define "epserve.args.attentionWorker" -}}
{{- $w := .Values.attentionWorkers -}}
{{- $name := include "epserve.attentionWorker.fullname" . -}}
- attention-worker
{{ include "epserve.args.common" . }}
- --shard=$(EPSERVE_SHARD)
- --of={{ $w.replicas }}
- --listen=0.0.0.0:{{ $w.port }}
{{- if eq $w.advertise "dns" }}
- --advertise=$(POD_NAME).{{ include "epserve.headlessDomain" (dict "ctx" . "name" $name) }}:{{ $w.port }}
{{- else if eq $w.advertise "podIP" }}
{{- if .Values.tls.enabled }}
{{- fail "attentionWorkers.advertise must be dns with tls.enabled: the coordinator checks that a worker's certificate names the address it registers in etcd, and a pod IP is not known when the certificate is made" }}
{{- end }}
- --advertise=$(POD_IP):{{ $w.port }}
{{- else }}
{{- fail (printf "attentionWorkers.advertise must be dns or podIP (got %s)" $w.advertise) }}
{{- end }}
{{- with $w.kvCacheMemory }}
- --kv-cache-memory={{ . }}
{{- end }}
- --block-size={{ .Values.coordinator.blockSize }}
{{- with .Values.coordinator.kvCacheDtype }}
- --kv-cache-dtype={{ . }}
{{- end }}
{{- with .Values.coordinator.denseDtype }}
- --dense-dtype={{ . }}
{{- end }}
{{- include "epserve.args.tls" . }}
{{- range $w.extraArgs }}
- {{ . }}
{{- end }}
{{- end }}

{{/*
epserve ctl (the helm test pod): the coordinator's admin Service, mutual TLS with the
client certificate, the token from EPSERVE_ADMIN_TOKEN; lists the registered workers.
*/}}
{{- define "epserve.args.ctl" -}}
- ctl
- --admin={{ include "epserve.coordinator.fullname" . }}-admin.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}:{{ .Values.coordinator.adminService.port }}
{{- include "epserve.args.tls" . }}
- workers
{{- end }}
