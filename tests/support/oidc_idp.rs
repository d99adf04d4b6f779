//! A real OpenID Provider for the tests: `oauth2-mock-server` (pinned in `.ci/test-peers`,
//! installed by `.ci/install-test-peers`) run by `tests/support/oidc_idp.mjs` on
//! 127.0.0.1, killed when dropped.
//!
//! When the package is not installed, `Idp::start` fails the test, saying how to install
//! it, like `clis.rs`.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const PINS: &str = include_str!("../../.ci/test-peers");
const LAUNCHER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/oidc_idp.mjs");

pub struct Idp {
    pub port: u16,
    pub issuer: String,
    child: Child,
    dir: TempDir,
    http: reqwest::Client,
}

/// The installed `node_modules` of the pinned provider, or None (see the module docs).
fn modules() -> PathBuf {
    let spec = PINS
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("oauth2-mock-server@"))
        .expect("oauth2-mock-server is pinned in .ci/test-peers");
    let cache = std::env::var_os("AGENTRY_TEST_PEERS_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
                .join(".cache/agentry/test-peers")
        });
    let dir = cache.join(spec).join("node_modules");
    assert!(
        dir.join("oauth2-mock-server/package.json").exists(),
        "{spec} is not installed at {}; run the tests with .ci/test, which installs it \
         (or run .ci/install-test-peers)",
        dir.display()
    );
    dir
}

/// The user the provider signs in, as the test last wrote it.
pub fn user(sub: &str, groups: &[&str]) -> Value {
    json!({"sub": sub, "email": format!("{sub}@example.com"), "name": format!("User {sub}"), "groups": groups})
}

impl Idp {
    /// A provider on a free port with a random key id.
    pub async fn start() -> Idp {
        Self::start_with(0, None).await
    }

    /// A provider on `port` (0: any) whose first key has `kid`.
    pub async fn start_with(port: u16, kid: Option<&str>) -> Idp {
        let modules = modules();
        agentry::telemetry::install_crypto_provider();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("user.json"), user("alice", &[]).to_string()).unwrap();
        let mut cmd = Command::new("node");
        cmd.arg(LAUNCHER)
            .env("IDP_MODULES", &modules)
            .env("IDP_PORT", port.to_string())
            .env("IDP_USER", dir.path().join("user.json"))
            .env("IDP_AUDIENCE", "agentry")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        if let Some(k) = kid {
            cmd.env("IDP_KID", k);
        }
        let mut child = cmd.spawn().expect("node runs the test provider");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the provider starts within 30 s")
            .unwrap()
            .expect("the provider prints where it listens");
        let ready: Value = serde_json::from_str(&line).unwrap();
        let idp = Idp {
            port: ready["port"].as_u64().unwrap() as u16,
            issuer: ready["issuer"].as_str().unwrap().to_owned(),
            child,
            dir,
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
        };
        // Discovery answers before a test uses it.
        let res = idp
            .http
            .get(format!("{}/.well-known/openid-configuration", idp.issuer))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        idp
    }

    /// The user the provider signs in from now on.
    pub fn set_user(&self, user: Value) {
        std::fs::write(self.dir.path().join("user.json"), user.to_string()).unwrap();
    }

    async fn control(&self, path: &str, body: Value) -> Value {
        let res = self
            .http
            .post(format!("{}/_test/{path}", self.issuer))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
        res.json().await.unwrap()
    }

    /// Replace the provider's whole key set by one new RS256 key; returns its kid.
    pub async fn rotate(&self) -> String {
        self.rotate_to("RS256").await
    }

    /// Replace the provider's whole key set by one new key for `alg` (published with
    /// that `alg`; the token endpoint signs with it); returns its kid.
    pub async fn rotate_to(&self, alg: &str) -> String {
        self.control("rotate", json!({"alg": alg})).await["kid"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// Sign `claims` with the current key's material under another `alg` than the one
    /// the key is published for.
    pub async fn sign_as(&self, alg: &str, claims: Value) -> String {
        self.control(
            "sign",
            json!({"key": "current", "alg": alg, "claims": claims}),
        )
        .await["token"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// Sign exactly `claims` (see oidc_idp.mjs for `key`).
    pub async fn sign(&self, key: &str, header: Value, claims: Value) -> String {
        self.control(
            "sign",
            json!({"key": key, "header": header, "claims": claims}),
        )
        .await["token"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// An access token for a service client (client credentials grant).
    pub async fn client_credentials(&self, client_id: &str) -> String {
        let res = self
            .http
            .post(format!("{}/token", self.issuer))
            .basic_auth(client_id, Some("secret"))
            .form(&[("grant_type", "client_credentials"), ("scope", "api")])
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        let body: Value = res.json().await.unwrap();
        body["access_token"].as_str().unwrap().to_owned()
    }

    /// Tokens for the current user through the authorization code flow with PKCE: the
    /// provider's redirect is read for the code, which is exchanged with the verifier.
    pub async fn authorization_code(&self, client_id: &str) -> Value {
        use base64::Engine;
        use sha2::Digest;
        let verifier = format!("v{}", uuid::Uuid::now_v7().simple()).repeat(2);
        let challenge = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(sha2::Sha256::digest(verifier.as_bytes()));
        let redirect = "http://127.0.0.1:9/callback";
        let authorize = url::Url::parse_with_params(
            &format!("{}/authorize", self.issuer),
            &[
                ("response_type", "code"),
                ("client_id", client_id),
                ("redirect_uri", redirect),
                ("scope", "openid email profile"),
                ("state", "s"),
                ("code_challenge", challenge.as_str()),
                ("code_challenge_method", "S256"),
            ],
        )
        .unwrap();
        let res = self.http.get(authorize).send().await.unwrap();
        assert_eq!(res.status(), 302);
        let location = url::Url::parse(res.headers()["location"].to_str().unwrap()).unwrap();
        let code = location
            .query_pairs()
            .find(|(k, _)| k == "code")
            .map(|(_, v)| v.into_owned())
            .expect("a code");
        let res = self
            .http
            .post(format!("{}/token", self.issuer))
            .form(&[
                ("grant_type", "authorization_code"),
                ("client_id", client_id),
                ("code", code.as_str()),
                ("code_verifier", verifier.as_str()),
                ("redirect_uri", redirect),
            ])
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        res.json().await.unwrap()
    }

    /// Stop the provider (SIGKILL) and wait for it to exit.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}
