//! The deployment files say what the server accepts: the settings file of the Kubernetes
//! ConfigMap loads (with the environment the Secret provides), and the variables the
//! manifests and the compose file set are ones the server reads. (.ci/check-deploy lints
//! the Dockerfile and validates the manifests against the Kubernetes schemas.)

use agentry::config::Settings;

const MANIFESTS: &str = include_str!("../deploy/kubernetes/agentry.yaml");

/// The `agentry.toml: |` block of the ConfigMap, unindented.
fn configmap_settings() -> String {
    let mut lines = MANIFESTS.lines();
    let start = lines
        .by_ref()
        .find(|l| l.trim_start() == "agentry.toml: |")
        .expect("the ConfigMap holds agentry.toml");
    let indent = start.len() - start.trim_start().len() + 2;
    lines
        .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() >= indent)
        .map(|l| l.get(indent..).unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_kubernetes_settings_load_with_the_secrets_environment() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agentry.toml");
    std::fs::write(&file, configmap_settings()).unwrap();
    // The Secret's variables, and the Deployment's with the pod's name and IP filled in.
    let mut env = vec![(
        "DATABASE_URL".to_owned(),
        "postgres://agentry:change-me@postgres:5432/agentry".to_owned(),
    )];
    for line in MANIFESTS.lines() {
        let Some(rest) = line.trim().strip_prefix("- {name: AGENTRY_") else {
            continue;
        };
        let (name, value) = rest.split_once(", value: ").unwrap();
        let value = value
            .trim_end_matches('}')
            .trim_matches('"')
            .replace("$(POD_NAME)", "agentry-7d9f8c-x2x4q")
            .replace("$(POD_IP)", "10.1.2.3");
        env.push((format!("AGENTRY_{name}"), value));
    }
    assert_eq!(env.len(), 3, "{env:?}");
    let s = Settings::load_from(Some(&file), &env).expect("the ConfigMap's settings load");
    assert_eq!(s.listen, "0.0.0.0:8080");
    assert_eq!(s.data_dir, std::path::Path::new("/var/lib/agentry"));
    assert!(s.database.url.is_some(), "DATABASE_URL is read");
    assert_eq!(s.replica(), "agentry-7d9f8c-x2x4q");
    assert_eq!(
        s.cluster.advertise_url.as_deref(),
        Some("http://10.1.2.3:8080")
    );
    assert!(
        s.cluster.drain_timeout_s + 10 <= 60,
        "terminationGracePeriodSeconds leaves time to drain"
    );

    // The commented OIDC table is the documented shape.
    let with_oidc = configmap_settings()
        .lines()
        .map(|l| l.strip_prefix("# ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&file, with_oidc).unwrap();
    env.push((
        "AGENTRY_AUTH__OIDC__CLIENT_SECRET".to_owned(),
        "s3cret".to_owned(),
    ));
    let s = Settings::load_from(Some(&file), &env).expect("with OIDC and its client secret");
    let oidc = s.auth.oidc.expect("the OIDC table");
    assert!(oidc.client_secret.is_some());
}
