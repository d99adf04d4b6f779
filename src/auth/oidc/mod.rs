//! OpenID Connect: the identity provider's discovery document and keys, validation of
//! its JWTs (bearer access tokens and ID tokens), and the users and team memberships they
//! stand for. Discovery runs in the background from start, retrying with backoff; until
//! the keys are loaded the server is not ready and JWTs answer 503 `idp_unavailable`.
//! The key set is cached; a token naming an unknown `kid` refetches it, at most once per
//! `jwks_refetch_min_interval_s`, so rotation needs no restart and a removed key stops
//! validating after that refetch (the set is also refreshed when it is an hour old).

pub mod browser;
mod jwt;
mod keys;
mod users;

use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{Map, Value};
use tokio::runtime::Handle;

pub use jwt::{MAX_TOKEN_BYTES, looks_like_jwt};
pub use users::{IdpIdentity, mapping_key, principal_for, reserved_team_names};

use crate::auth::AuthError;
use crate::config::OidcSettings;
use keys::SigningKey;

/// The cached key set is fetched again when it is older than this, whatever the tokens
/// name.
const KEYS_MAX_AGE: Duration = Duration::from_secs(3600);

/// The endpoints the discovery document names.
#[derive(Debug, Clone, Deserialize)]
pub struct ProviderMetadata {
    pub issuer: String,
    pub jwks_uri: String,
    #[serde(default)]
    pub authorization_endpoint: Option<String>,
    #[serde(default)]
    pub token_endpoint: Option<String>,
}

/// A handle on the identity provider; cheap to clone.
#[derive(Clone)]
pub struct Oidc {
    inner: Arc<Inner>,
}

struct Inner {
    settings: OidcSettings,
    http: reqwest::Client,
    /// Set once discovery and the first key fetch succeeded.
    provider: RwLock<Option<Arc<ProviderMetadata>>>,
    keys: RwLock<Arc<Vec<SigningKey>>>,
    /// When the key set was last fetched (successfully or not).
    last_fetch: RwLock<Option<Instant>>,
    /// One refetch at a time; the others wait and use its result.
    refetch: tokio::sync::Mutex<()>,
}

impl Oidc {
    /// Start discovery in the background on `runtime`; it retries with backoff until the
    /// provider answers, and stops when every handle is dropped.
    pub fn start(settings: OidcSettings, runtime: &Handle) -> anyhow::Result<Self> {
        crate::telemetry::install_crypto_provider();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        let inner = Arc::new(Inner {
            settings,
            http,
            provider: RwLock::new(None),
            keys: RwLock::new(Arc::new(Vec::new())),
            last_fetch: RwLock::new(None),
            refetch: tokio::sync::Mutex::new(()),
        });
        runtime.spawn(discover_until_ready(Arc::downgrade(&inner)));
        Ok(Self { inner })
    }

    pub fn settings(&self) -> &OidcSettings {
        &self.inner.settings
    }

    /// Discovery succeeded and the keys are loaded.
    pub fn is_ready(&self) -> bool {
        self.metadata().is_some()
    }

    pub fn metadata(&self) -> Option<Arc<ProviderMetadata>> {
        self.inner.provider.read().expect("lock").clone()
    }

    pub(crate) fn http(&self) -> &reqwest::Client {
        &self.inner.http
    }

    /// Validate a bearer access token: signature, `iss`, `aud` one of `audience`, times.
    pub async fn validate_access_token(
        &self,
        token: &str,
    ) -> Result<Map<String, Value>, AuthError> {
        self.validate(token, &self.inner.settings.audience).await
    }

    /// Validate a JWT whose `aud` must contain one of `audiences`; the claims on success.
    pub async fn validate(
        &self,
        token: &str,
        audiences: &[String],
    ) -> Result<Map<String, Value>, AuthError> {
        let s = &self.inner.settings;
        let header = jwt::header(token)?;
        let alg = s
            .allowed_algs
            .contains(&header.alg)
            .then(|| header.alg.parse::<jsonwebtoken::Algorithm>().ok())
            .flatten()
            .ok_or_else(|| {
                AuthError::TokenAlgorithmNotAllowed(format!(
                    "tokens signed with `{}` are not accepted (accepted: {})",
                    header.alg,
                    s.allowed_algs.join(", ")
                ))
            })?;
        if !self.is_ready() {
            return Err(AuthError::IdpUnavailable(
                "the identity provider's keys are not loaded yet; retry shortly".into(),
            ));
        }
        let key = self.key_for(header.kid.as_deref(), alg).await?;
        jwt::verify(
            token,
            &key.key,
            &jwt::Expected {
                alg,
                issuer: &s.issuer,
                audiences,
                leeway_s: s.leeway_s,
            },
        )
    }

    /// The key the token names, refetching the key set once (rate-limited) when the
    /// `kid` is unknown. A key whose family does not fit the algorithm is refused.
    async fn key_for(
        &self,
        kid: Option<&str>,
        alg: jsonwebtoken::Algorithm,
    ) -> Result<SigningKey, AuthError> {
        let stale = self
            .inner
            .last_fetch
            .read()
            .expect("lock")
            .is_some_and(|at| at.elapsed() >= KEYS_MAX_AGE);
        if stale {
            // Keys the provider removed without introducing a new kid go away too.
            let _one = self.inner.refetch.lock().await;
            let still_stale = self
                .inner
                .last_fetch
                .read()
                .expect("lock")
                .is_some_and(|at| at.elapsed() >= KEYS_MAX_AGE);
            if still_stale && let Err(e) = self.refresh_keys().await {
                tracing::warn!(error = %e, "could not refresh the identity provider's keys");
            }
        }
        if let Some(k) = self.find_key(kid, alg)? {
            return Ok(k);
        }
        let before = *self.inner.last_fetch.read().expect("lock");
        let _one = self.inner.refetch.lock().await;
        let after = *self.inner.last_fetch.read().expect("lock");
        let min = Duration::from_secs(self.inner.settings.jwks_refetch_min_interval_s);
        // Someone else refetched while we waited: use their result.
        let refetched_meanwhile = after != before;
        let may_refetch = after.is_none_or(|at| at.elapsed() >= min);
        if !refetched_meanwhile
            && may_refetch
            && let Err(e) = self.refresh_keys().await
        {
            tracing::warn!(error = %e, "could not refetch the identity provider's keys");
        }
        self.find_key(kid, alg)?.ok_or(AuthError::TokenUnknownKey)
    }

    fn find_key(
        &self,
        kid: Option<&str>,
        alg: jsonwebtoken::Algorithm,
    ) -> Result<Option<SigningKey>, AuthError> {
        let keys = self.inner.keys.read().expect("lock").clone();
        let found = match kid {
            Some(kid) => keys.iter().find(|k| k.kid.as_deref() == Some(kid)),
            // No `kid`: only unambiguous when one key fits the algorithm.
            None => {
                let mut fitting = keys.iter().filter(|k| k.fits(alg));
                match (fitting.next(), fitting.next()) {
                    (Some(k), None) => Some(k),
                    _ => None,
                }
            }
        };
        match found {
            Some(k) if !k.fits(alg) => Err(AuthError::TokenAlgorithmNotAllowed(format!(
                "the key the token names does not sign with `{alg:?}`"
            ))),
            Some(k) => Ok(Some(k.clone())),
            None => Ok(None),
        }
    }

    async fn refresh_keys(&self) -> anyhow::Result<()> {
        *self.inner.last_fetch.write().expect("lock") = Some(Instant::now());
        let uri = match (&self.inner.settings.jwks_uri, self.metadata()) {
            (Some(u), _) => u.clone(),
            (None, Some(m)) => m.jwks_uri.clone(),
            (None, None) => anyhow::bail!("no jwks_uri yet"),
        };
        let keys = fetch_keys(&self.inner.http, &uri).await?;
        *self.inner.keys.write().expect("lock") = Arc::new(keys);
        Ok(())
    }
}

async fn fetch_keys(http: &reqwest::Client, uri: &str) -> anyhow::Result<Vec<SigningKey>> {
    let res = http.get(uri).send().await?.error_for_status()?;
    let body = res.bytes().await?;
    keys::parse_jwks(&body).map_err(anyhow::Error::msg)
}

async fn discover(inner: &Inner) -> anyhow::Result<()> {
    let s = &inner.settings;
    let url = format!(
        "{}/.well-known/openid-configuration",
        s.issuer.trim_end_matches('/')
    );
    let meta: ProviderMetadata = inner
        .http
        .get(&url)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    if meta.issuer != s.issuer {
        anyhow::bail!(
            "the discovery document at {url} names issuer `{}`, not the configured `{}`",
            meta.issuer,
            s.issuer
        );
    }
    let uri = s.jwks_uri.clone().unwrap_or_else(|| meta.jwks_uri.clone());
    let keys = fetch_keys(&inner.http, &uri).await?;
    if keys.is_empty() {
        anyhow::bail!("the key set at {uri} has no signature key this server can use");
    }
    *inner.keys.write().expect("lock") = Arc::new(keys);
    *inner.last_fetch.write().expect("lock") = Some(Instant::now());
    *inner.provider.write().expect("lock") = Some(Arc::new(meta));
    Ok(())
}

/// Retry discovery with backoff (0.2 s doubling to 10 s) until it succeeds or the
/// handle is gone.
async fn discover_until_ready(inner: Weak<Inner>) {
    let mut delay = Duration::from_millis(200);
    loop {
        let Some(strong) = inner.upgrade() else {
            return;
        };
        match discover(&strong).await {
            Ok(()) => {
                tracing::info!(issuer = %strong.settings.issuer, "identity provider keys loaded");
                return;
            }
            Err(e) => tracing::warn!(
                issuer = %strong.settings.issuer, error = %e,
                "identity provider discovery failed; retrying in {delay:?}"
            ),
        }
        drop(strong);
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(10));
    }
}
