{{/* What the relay and the migrate job share: the config file and the secrets as files. */}}
{{- define "idem.volumes" -}}
- name: secrets
  projected:
    sources:
      - secret:
          name: {{ .Values.secrets.postgres.name }}
          items: [{ key: {{ .Values.secrets.postgres.key }}, path: postgres-url }]
      {{- with .Values.secrets.adminTokens }}
      - secret:
          name: {{ .name }}
          items: [{ key: {{ .key }}, path: admin-tokens }]
      {{- end }}
      {{- with .Values.secrets.readToken }}
      - secret:
          name: {{ .name }}
          items: [{ key: {{ .key }}, path: read-token }]
      {{- end }}
      {{- with .Values.secrets.kafkaPassword }}
      - secret:
          name: {{ .name }}
          items: [{ key: {{ .key }}, path: kafka-password }]
      {{- end }}
- name: tmp
  emptyDir: {}
{{- end -}}

{{- define "idem.mounts" -}}
- { name: config, mountPath: /etc/idem, readOnly: true }
- { name: secrets, mountPath: /var/run/secrets/idem, readOnly: true }
- { name: tmp, mountPath: /tmp }
{{- end -}}

{{- define "idem.env" -}}
- { name: IDEM_POSTGRES_URL_FILE, value: /var/run/secrets/idem/postgres-url }
{{- with .Values.secrets.adminTokens }}
- { name: IDEM_ADMIN_TOKENS_FILE, value: /var/run/secrets/idem/admin-tokens }
{{- end }}
{{- with .Values.secrets.readToken }}
- { name: IDEM_ADMIN_READ_TOKEN_FILE, value: /var/run/secrets/idem/read-token }
{{- end }}
{{- end -}}
