{{/*
Named templates of the kmq-tracker chart.

Every template takes a chart context (.Values, .Release, .Chart, .Files): this chart's own `.`,
or, from a chart that has kmq-tracker as a dependency, `(index .Subcharts "kmq-tracker")`. The
"kmq-tracker.sidecar.*" templates are the public ones for that (docs/sidecar.md).
*/}}

{{- define "kmq-tracker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kmq-tracker.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kmq-tracker.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kmq-tracker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kmq-tracker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: tracker
{{- end -}}

{{/* The API Deployment's pods (apiDeployment): not the tracker's selector, not the tracker's Service. */}}
{{- define "kmq-tracker.apiSelectorLabels" -}}
app.kubernetes.io/name: {{ include "kmq-tracker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: api
{{- end -}}

{{- define "kmq-tracker.labels" -}}
helm.sh/chart: {{ include "kmq-tracker.chart" . }}
app.kubernetes.io/name: {{ include "kmq-tracker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kmq-tracker
{{- end -}}

{{- define "kmq-tracker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kmq-tracker.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kmq-tracker.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "kmq-tracker.secretName" -}}
{{- default (include "kmq-tracker.fullname" .) .Values.existingSecret -}}
{{- end -}}

{{/* "true" when the pods migrate the schema themselves (an init container). */}}
{{- define "kmq-tracker.migrateInPod" -}}
{{- if or (eq .Values.database.type "sqlite") (eq .Values.migration.mode "initContainer") -}}
true
{{- end -}}
{{- end -}}

{{/* The API token: the given one, the one already in the release's Secret, or a new one. */}}
{{- define "kmq-tracker.apiToken" -}}
{{- if .Values.api.token -}}
{{- .Values.api.token -}}
{{- else if .Values.api.generateToken -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "kmq-tracker.fullname" .) -}}
{{- $kept := dig "data" .Values.secretKeys.apiToken "" ($existing | default dict) -}}
{{- if $kept -}}
{{- $kept | b64dec -}}
{{- else -}}
{{- randAlphaNum 40 -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The tracker's settings file (TOML, docs/configuration.md): everything but secrets, which come
from the Secret as environment variables, and the HTTP address, which the probes depend on.
*/}}
{{- define "kmq-tracker.settingsToml" -}}
{{- $kafka := .Values.kafka -}}
{{- $security := $kafka.security -}}
{{- $settings := dict
  "kafka_bootstrap_servers" $kafka.bootstrapServers
  "markers_topic" $kafka.markersTopic
  "markers_partitions" (int $kafka.markersPartitions)
  "markers_replication_factor" (int $kafka.replicationFactor)
  "create_topics" $kafka.createTopics
  "tracker_group" $kafka.trackerGroup
  "log_level" .Values.log.level
  "log_format" .Values.log.format
  "default_policy" .Values.policies.default
  "kafka_security_protocol" $security.protocol
  "kafka_ssl_check_hostname" $security.tls.checkHostname
-}}
{{- if .Values.policies.topics -}}
{{- $_ := set $settings "topics" .Values.policies.topics -}}
{{- end -}}
{{- if $kafka.clientConfig -}}
{{- $_ := set $settings "kafka_client_config" $kafka.clientConfig -}}
{{- end -}}
{{- if eq .Values.database.type "sqlite" -}}
{{- $_ := set $settings "database_url" (printf "sqlite+aiosqlite:///%s" .Values.database.sqlitePath) -}}
{{- end -}}
{{- if hasPrefix "SASL_" $security.protocol -}}
{{- $_ := set $settings "kafka_sasl_mechanism" $security.sasl.mechanism -}}
{{- end -}}
{{- if $security.tls.secretName -}}
{{- $_ := set $settings "kafka_ssl_cafile" (printf "/etc/kmq/kafka-tls/%s" $security.tls.caKey) -}}
{{- if $security.tls.certKey -}}
{{- $_ := set $settings "kafka_ssl_certfile" (printf "/etc/kmq/kafka-tls/%s" $security.tls.certKey) -}}
{{- end -}}
{{- if $security.tls.keyKey -}}
{{- $_ := set $settings "kafka_ssl_keyfile" (printf "/etc/kmq/kafka-tls/%s" $security.tls.keyKey) -}}
{{- end -}}
{{- end -}}
{{- $settings = mergeOverwrite $settings (deepCopy .Values.config) -}}
# kmq-tracker settings (docs/configuration.md). Secrets come from the environment.
{{ include "kmq-tracker.toml" (dict "table" $settings "path" "") }}
{{- end -}}

{{/*
A table as TOML (Helm's toToml writes every number as a float: 5 becomes 5.0). Parameters:
(dict "table" <map> "path" <dotted name of the table, "" at the top>). Scalars and lists of
scalars are written as key = value, maps as [sub.tables] after them.
*/}}
{{- define "kmq-tracker.toml" -}}
{{- $table := .table -}}
{{- $path := .path -}}
{{- range $key := keys $table | sortAlpha -}}
{{- $value := index $table $key -}}
{{- if not (kindIs "map" $value) }}
{{ include "kmq-tracker.tomlKey" $key }} = {{ include "kmq-tracker.tomlValue" $value }}
{{- end -}}
{{- end -}}
{{- range $key := keys $table | sortAlpha -}}
{{- $value := index $table $key -}}
{{- if kindIs "map" $value -}}
{{- $name := include "kmq-tracker.tomlKey" $key -}}
{{- if $path -}}{{- $name = printf "%s.%s" $path $name -}}{{- end }}

[{{ $name }}]
{{- include "kmq-tracker.toml" (dict "table" $value "path" $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kmq-tracker.tomlKey" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . -}}{{ . }}{{- else -}}{{ toJson . }}{{- end -}}
{{- end -}}

{{- define "kmq-tracker.tomlValue" -}}
{{- if kindIs "float64" . -}}
{{- if eq . (float64 (int64 .)) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else if kindIs "slice" . -}}
[{{ range $i, $item := . }}{{ if $i }}, {{ end }}{{ include "kmq-tracker.tomlValue" $item }}{{ end }}]
{{- else if kindIs "invalid" . -}}
{{- fail "a setting is null: TOML cannot express it, leave it out" -}}
{{- else -}}
{{- toJson . -}}
{{- end -}}
{{- end -}}

{{/* A secretKeyRef environment variable. */}}
{{- define "kmq-tracker.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .secret }}
      key: {{ .key }}
      {{- if .optional }}
      optional: true
      {{- end }}
{{- end -}}

{{/* The tracker's environment: the settings file, the HTTP address, and the secrets. */}}
{{- define "kmq-tracker.env" -}}
{{- $secret := include "kmq-tracker.secretName" . -}}
{{- $keys := .Values.secretKeys -}}
- name: KMQ_CONFIG_FILE
  value: /etc/kmq/config/kmq.toml
- name: KMQ_HTTP_HOST
  value: "0.0.0.0"
- name: KMQ_HTTP_PORT
  value: {{ .Values.httpPort | int | quote }}
- name: KMQ_REPLICA_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- if eq .Values.database.type "postgres" }}
{{ include "kmq-tracker.secretEnv" (dict "name" "KMQ_DATABASE_URL" "secret" $secret "key" $keys.databaseUrl) }}
{{- end }}
{{ include "kmq-tracker.secretEnv" (dict "name" "KMQ_API_TOKEN" "secret" $secret "key" $keys.apiToken "optional" true) }}
{{ include "kmq-tracker.secretEnv" (dict "name" "KMQ_API_READ_TOKEN" "secret" $secret "key" $keys.apiReadToken "optional" true) }}
{{- if hasPrefix "SASL_" .Values.kafka.security.protocol }}
{{ include "kmq-tracker.secretEnv" (dict "name" "KMQ_KAFKA_SASL_USERNAME" "secret" $secret "key" $keys.kafkaSaslUsername) }}
{{ include "kmq-tracker.secretEnv" (dict "name" "KMQ_KAFKA_SASL_PASSWORD" "secret" $secret "key" $keys.kafkaSaslPassword) }}
{{- end }}
{{- if .Values.kafka.security.tls.keyKey }}
{{ include "kmq-tracker.secretEnv" (dict "name" "KMQ_KAFKA_SSL_KEY_PASSWORD" "secret" $secret "key" $keys.kafkaSslKeyPassword "optional" true) }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kmq-tracker.volumeMounts" -}}
- name: kmq-config
  mountPath: /etc/kmq/config
  readOnly: true
- name: kmq-tmp
  mountPath: /tmp
{{- if eq .Values.database.type "sqlite" }}
- name: kmq-data
  mountPath: {{ dir .Values.database.sqlitePath }}
{{- end }}
{{- if .Values.kafka.security.tls.secretName }}
- name: kmq-kafka-tls
  mountPath: /etc/kmq/kafka-tls
  readOnly: true
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Volumes of the pod, except the SQLite data volume (a claim template or existingClaim). */}}
{{- define "kmq-tracker.volumes" -}}
- name: kmq-config
  configMap:
    name: {{ include "kmq-tracker.fullname" . }}
- name: kmq-tmp
  emptyDir:
    sizeLimit: 64Mi
{{- if .Values.kafka.security.tls.secretName }}
- name: kmq-kafka-tls
  secret:
    secretName: {{ .Values.kafka.security.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kmq-tracker.probe" -}}
httpGet:
  path: {{ .probe.path }}
  port: kmq-http
periodSeconds: {{ .probe.periodSeconds }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- end -}}

{{/*
The tracker container. Parameters: (dict "ctx" <chart context> "resources" <resources>
"native" <bool: a native sidecar, restartPolicy Always> "command" <"run" (the default) or
"api": the admin API alone>).
*/}}
{{- define "kmq-tracker.container" -}}
{{- $ctx := .ctx -}}
{{- $command := default "run" .command -}}
{{- with $ctx -}}
name: {{ ternary "kmq-api" "kmq-tracker" (eq $command "api") }}
image: {{ include "kmq-tracker.image" . | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
args: [{{ $command | quote }}]
{{- if $.native }}
restartPolicy: Always
{{- end }}
ports:
  - name: kmq-http
    containerPort: {{ .Values.httpPort | int }}
    protocol: TCP
env:
  {{- include "kmq-tracker.env" . | nindent 2 }}
volumeMounts:
  {{- include "kmq-tracker.volumeMounts" . | nindent 2 }}
startupProbe:
  {{- include "kmq-tracker.probe" (dict "probe" .Values.probes.startup) | nindent 2 }}
livenessProbe:
  {{- include "kmq-tracker.probe" (dict "probe" .Values.probes.liveness) | nindent 2 }}
readinessProbe:
  {{- include "kmq-tracker.probe" (dict "probe" .Values.probes.readiness) | nindent 2 }}
resources:
  {{- toYaml $.resources | nindent 2 }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* The init container that runs `kmq-tracker migrate`. */}}
{{- define "kmq-tracker.migrateContainer" -}}
name: kmq-migrate
image: {{ include "kmq-tracker.image" . | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
args: ["migrate"]
env:
  {{- include "kmq-tracker.env" . | nindent 2 }}
volumeMounts:
  {{- include "kmq-tracker.volumeMounts" . | nindent 2 }}
resources:
  {{- toYaml .Values.migration.resources | nindent 2 }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
{{- end -}}

{{/* Pod template annotations: restart the pods when the settings or the Secret change. */}}
{{- define "kmq-tracker.podAnnotations" -}}
checksum/config: {{ include "kmq-tracker.settingsToml" . | sha256sum }}
{{- if not .Values.existingSecret }}
checksum/secret: {{ include "kmq-tracker.secretData" . | sha256sum }}
{{- end }}
{{- with .Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The data of the chart's Secret (without the random API token, for the checksum). */}}
{{- define "kmq-tracker.secretData" -}}
{{- $keys := .Values.secretKeys -}}
{{- if eq .Values.database.type "postgres" }}
{{ $keys.databaseUrl }}: {{ .Values.database.url | b64enc | quote }}
{{- end }}
{{- with .Values.api.readToken }}
{{ $keys.apiReadToken }}: {{ . | b64enc | quote }}
{{- end }}
{{- if hasPrefix "SASL_" .Values.kafka.security.protocol }}
{{ $keys.kafkaSaslUsername }}: {{ .Values.kafka.security.sasl.username | b64enc | quote }}
{{ $keys.kafkaSaslPassword }}: {{ .Values.kafka.security.sasl.password | b64enc | quote }}
{{- end }}
{{- end -}}

{{/*
The pod spec of the tracker's own workloads: the tracker (Deployment or StatefulSet; called
with the chart context) or the API Deployment (called with (dict "ctx" <chart context>
"command" "api")).
*/}}
{{- define "kmq-tracker.podSpec" -}}
{{- $command := "run" -}}
{{- $ctx := . -}}
{{- if hasKey . "ctx" -}}
{{- $command = .command -}}
{{- $ctx = .ctx -}}
{{- end -}}
{{- with $ctx -}}
{{- $resources := ternary .Values.apiDeployment.resources .Values.resources (eq $command "api") -}}
serviceAccountName: {{ include "kmq-tracker.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.serviceAccount.automountServiceAccountToken }}
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- if include "kmq-tracker.migrateInPod" . }}
initContainers:
  - {{ include "kmq-tracker.migrateContainer" . | indent 4 | trim }}
{{- end }}
containers:
  - {{ include "kmq-tracker.container" (dict "ctx" . "resources" $resources "command" $command) | indent 4 | trim }}
volumes:
  {{- include "kmq-tracker.volumes" . | nindent 2 }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Checks the schema cannot express. */}}
{{- define "kmq-tracker.validate" -}}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.maxReplicas) (int .Values.kafka.markersPartitions)) -}}
{{- fail (printf "autoscaling.maxReplicas (%d) exceeds kafka.markersPartitions (%d): replicas beyond the markers partitions own nothing" (int .Values.autoscaling.maxReplicas) (int .Values.kafka.markersPartitions)) -}}
{{- end -}}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) -}}
{{- fail "autoscaling.minReplicas exceeds autoscaling.maxReplicas" -}}
{{- end -}}
{{- if and (eq .Values.database.type "postgres") (eq .Values.mode "deployment") (not .Values.autoscaling.enabled) (gt (int .Values.replicaCount) (int .Values.kafka.markersPartitions)) -}}
{{- fail (printf "replicaCount (%d) exceeds kafka.markersPartitions (%d): replicas beyond the markers partitions own nothing" (int .Values.replicaCount) (int .Values.kafka.markersPartitions)) -}}
{{- end -}}
{{- end -}}

{{/* ---------------------------------------------------------------------------------------
Sidecar mode: public templates to include in your own pod spec (docs/sidecar.md). Call them
with the kmq-tracker dependency's context:

  containers:
    - name: app
      ...
    {{- include "kmq-tracker.sidecar.containers" (index .Subcharts "kmq-tracker") | nindent 4 }}
  initContainers:
    {{- include "kmq-tracker.sidecar.initContainers" (index .Subcharts "kmq-tracker") | nindent 4 }}
  volumes:
    {{- include "kmq-tracker.sidecar.volumes" (index .Subcharts "kmq-tracker") | nindent 4 }}
--------------------------------------------------------------------------------------- */}}

{{/* The tracker container (a list item); empty with sidecar.native (see initContainers). */}}
{{- define "kmq-tracker.sidecar.containers" -}}
{{- if not .Values.sidecar.native -}}
- {{ include "kmq-tracker.container" (dict "ctx" . "resources" .Values.sidecar.resources) | indent 2 | trim }}
{{- end -}}
{{- end -}}

{{/* Init containers (list items): the migration (SQLite, or migration.mode initContainer),
then the tracker itself as a native sidecar (sidecar.native). */}}
{{- define "kmq-tracker.sidecar.initContainers" -}}
{{- if include "kmq-tracker.migrateInPod" . }}
- {{ include "kmq-tracker.migrateContainer" . | indent 2 | trim }}
{{- end }}
{{- if .Values.sidecar.native }}
- {{ include "kmq-tracker.container" (dict "ctx" . "resources" .Values.sidecar.resources "native" true) | indent 2 | trim }}
{{- end }}
{{- end -}}

{{/* The volumes the tracker container needs (list items). */}}
{{- define "kmq-tracker.sidecar.volumes" -}}
{{ include "kmq-tracker.volumes" . }}
{{- if eq .Values.database.type "sqlite" }}
- name: kmq-data
  persistentVolumeClaim:
    claimName: {{ .Values.persistence.existingClaim }}
{{- end }}
{{- end -}}

{{/* Environment for your app container (list items): where the sidecar marker endpoint is
(KMQ_SIDECAR_URL, on the pod's loopback) and the token it requires (KMQ_API_TOKEN). */}}
{{- define "kmq-tracker.sidecar.appEnv" -}}
- name: KMQ_SIDECAR_URL
  value: {{ printf "http://127.0.0.1:%d" (int .Values.httpPort) | quote }}
{{ include "kmq-tracker.secretEnv" (dict "name" "KMQ_API_TOKEN" "secret" (include "kmq-tracker.secretName" .) "key" .Values.secretKeys.apiToken) }}
{{- end -}}

{{/* Annotations for your pod template: restart your pods when the tracker's settings change. */}}
{{- define "kmq-tracker.sidecar.podAnnotations" -}}
{{ include "kmq-tracker.podAnnotations" . }}
{{- end -}}
