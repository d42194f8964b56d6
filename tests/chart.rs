//! The Helm chart (`deploy/helm/idem`): it lints, renders with its options off and on, and what
//! it renders validates offline against the Kubernetes schemas (`kubernetes-validate`).
//! `deploy/test.sh` installs both tools; `IDEM_HELM` and `IDEM_KUBERNETES_VALIDATE` name them.

use std::path::Path;
use std::process::Command;

use serde::Deserialize;

fn chart() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/helm/idem")
}

fn run(tool_env: &str, default: &str, args: &[&str]) -> String {
    let tool = std::env::var(tool_env).unwrap_or_else(|_| default.to_string());
    let out = Command::new(&tool).args(args).output().unwrap_or_else(|e| {
        panic!("{tool} runs (deploy/test.sh installs it; {tool_env} names it): {e}")
    });
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Every manifest `helm template` renders with these `--set` values.
fn render(sets: &[&str]) -> Vec<serde_json::Value> {
    let mut args = vec!["template", "rel", chart()];
    for s in sets {
        args.extend(["--set", s]);
    }
    let text = run("IDEM_HELM", "helm", &args);
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| serde_json::Value::deserialize(doc).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn kind<'a>(docs: &'a [serde_json::Value], kind: &str) -> &'a serde_json::Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} rendered"))
}

/// The core objects (not the operators' CRDs) against the Kubernetes schemas, strictly.
fn validate(docs: &[serde_json::Value], dir: &Path) {
    let core: Vec<&serde_json::Value> = docs
        .iter()
        .filter(|d| !matches!(d["kind"].as_str(), Some("ServiceMonitor" | "ScaledObject")))
        .collect();
    for (i, doc) in core.iter().enumerate() {
        let file = dir.join(format!("{i}.yaml"));
        std::fs::write(&file, serde_norway::to_string(doc).unwrap()).unwrap();
        run(
            "IDEM_KUBERNETES_VALIDATE",
            "kubernetes-validate",
            &["--strict", "--quiet", file.to_str().unwrap()],
        );
    }
}

#[test]
fn the_chart_lints_renders_and_validates() {
    run("IDEM_HELM", "helm", &["lint", "--strict", chart()]);
    let dir = tempfile::tempdir().unwrap();

    let defaults = render(&[]);
    validate(&defaults, dir.path());
    let deployment = kind(&defaults, "Deployment");
    let pod = &deployment["spec"]["template"]["spec"];
    let relay = &pod["containers"][0];
    assert_eq!(relay["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(relay["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(relay["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(pod["terminationGracePeriodSeconds"], 45);
    assert!(
        relay["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "IDEM_POSTGRES_URL_FILE"),
        "the Postgres URL comes from a mounted Secret"
    );
    let job = kind(&defaults, "Job");
    assert_eq!(
        job["metadata"]["annotations"]["helm.sh/hook"],
        "pre-install,pre-upgrade"
    );
    kind(&defaults, "PodDisruptionBudget");
    kind(&defaults, "Service");
    assert!(defaults.iter().all(|d| d["kind"] != "ScaledObject"));

    let everything = render(&[
        "serviceMonitor.enabled=true",
        "keda.enabled=true",
        "secrets.adminTokens.name=idem-admin",
        "secrets.adminTokens.key=tokens",
        "secrets.readToken.name=idem-admin",
        "secrets.readToken.key=read",
    ]);
    validate(&everything, dir.path());
    let scaled = kind(&everything, "ScaledObject");
    assert_eq!(
        scaled["spec"]["triggers"][0]["metadata"]["topic"],
        "idem.actions"
    );
    assert_eq!(
        scaled["spec"]["triggers"][0]["metadata"]["consumerGroup"],
        "idem"
    );
    kind(&everything, "ServiceMonitor");
    let deployment = kind(&everything, "Deployment");
    assert!(
        deployment["spec"].get("replicas").is_none(),
        "KEDA owns the replica count"
    );
    let env: Vec<&str> = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(env.contains(&"IDEM_ADMIN_TOKENS_FILE") && env.contains(&"IDEM_ADMIN_READ_TOKEN_FILE"));
}
