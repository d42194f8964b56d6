{{- define "idem.name" -}}{{ .Release.Name }}-idem{{- end -}}

{{- define "idem.labels" -}}
app.kubernetes.io/name: idem
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "idem.selector" -}}
app.kubernetes.io/name: idem
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "idem.image" -}}{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}{{- end -}}

{{/* The pod's security settings: non-root, nothing writable but /tmp, no privileges. */}}
{{- define "idem.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
seccompProfile: { type: RuntimeDefault }
{{- end -}}

{{- define "idem.containerSecurity" -}}
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities: { drop: ["ALL"] }
{{- end -}}

