{{/*
The prefix of every object name: fullnameOverride, else the release name
if it contains the chart's name, else <release>-<chart>.
*/}}
{{- define "rbd-nbd-go.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rbd-nbd-go.nodeplugin.fullname" -}}
{{- printf "%s-%s" (include "rbd-nbd-go.fullname" .) .Values.nodeplugin.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rbd-nbd-go.provisioner.fullname" -}}
{{- printf "%s-%s" (include "rbd-nbd-go.fullname" .) .Values.provisioner.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rbd-nbd-go.snapshotController.fullname" -}}
{{- printf "%s-%s" (include "rbd-nbd-go.fullname" .) .Values.snapshotController.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The driver's image; an empty tag is the chart's appVersion. */}}
{{- define "rbd-nbd-go.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}

{{/* An image block {repository, tag}: repository:tag. */}}
{{- define "rbd-nbd-go.imageOf" -}}
{{- printf "%s:%s" .repository (.tag | toString) -}}
{{- end -}}

{{/*
A value as JSON on one line, with ", " and ": " between items (as the
hand-written config.json of deploy/kubernetes). Maps in key order.
*/}}
{{- define "rbd-nbd-go.inlineJson" -}}
{{- if kindIs "slice" . -}}
[{{ range $i, $v := . }}{{ if $i }}, {{ end }}{{ include "rbd-nbd-go.inlineJson" $v }}{{ end }}]
{{- else if kindIs "map" . -}}
{{ "{" }}{{ range $i, $k := keys . | sortAlpha }}{{ if $i }}, {{ end }}{{ toJson $k }}: {{ include "rbd-nbd-go.inlineJson" (get $ $k) }}{{ end }}{{ "}" }}
{{- else -}}
{{ toJson . }}
{{- end -}}
{{- end -}}

{{/*
csiConfig as config.json: one line a key of each cluster, the values
inline, so that the default renders deploy/kubernetes/configmap.yaml's
text exactly.
*/}}
{{- define "rbd-nbd-go.csiConfig" -}}
{{- if not . -}}
[]
{{- else -}}
[
{{- range $i, $c := . }}
  {
  {{- $keys := keys $c | sortAlpha }}
  {{- range $j, $k := $keys }}
    {{ toJson $k }}: {{ include "rbd-nbd-go.inlineJson" (get $c $k) }}{{ if lt (add1 $j) (len $keys) }},{{ end }}
  {{- end }}
  }{{ if lt (add1 $i) (len $) }},{{ end }}
{{- end }}
]
{{- end -}}
{{- end -}}

{{/*
The controller's podAntiAffinity: more replicas (leader election picks
one) want a node each, as the liveness and metrics ports are on the host.
*/}}
{{- define "rbd-nbd-go.provisioner.antiAffinity" -}}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - labelSelector:
        matchLabels:
          app: {{ include "rbd-nbd-go.provisioner.fullname" . }}
      topologyKey: kubernetes.io/hostname
{{- end -}}
