//! Calling a hook's URL: the signed POST (`Agentry-Signature: sha256=<HMAC-SHA256 of
//! "<timestamp>.<body>">`), no redirects, a bounded time and answer size, and the address
//! rule: a team's hook never reaches a loopback, private or link-local address — checked
//! on the URL when the hook is saved and on every address its host resolves to when it
//! is called (so DNS cannot rebind around the first check), unless
//! `hooks.allow_private_networks`. Also the outbox worker that sends notifications.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use ring::hmac;
use url::{Host, Url};

use crate::config::HookSettings;

/// Answers larger than this are cut (a waiting hook's replacement must fit).
pub const MAX_ANSWER_BYTES: usize = 1024 * 1024;

/// `sha256=<lowercase hex HMAC-SHA256(secret, "<timestamp>.<body>")>`.
pub fn signature(secret: &[u8], timestamp: i64, body: &[u8]) -> String {
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
    let mut ctx = hmac::Context::with_key(&key);
    ctx.update(timestamp.to_string().as_bytes());
    ctx.update(b".");
    ctx.update(body);
    format!("sha256={}", hex::encode(ctx.sign().as_ref()))
}

pub use crate::domain::net::is_internal;

/// Check a hook URL as it is saved: http or https, a host, on the allow-list when there
/// is one, and for a team's hook (unless allowed) no internal literal address.
pub fn check_url(raw: &str, team_hook: bool, settings: &HookSettings) -> Result<Url, String> {
    let url = Url::parse(raw).map_err(|e| format!("not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err("must be an http:// or https:// URL".into());
    }
    if raw.len() > 2048 {
        return Err("must be at most 2048 characters".into());
    }
    let host = url.host().ok_or("must name a host")?;
    if let Some(allowed) = &settings.allowed_hosts {
        let name = match &host {
            Host::Domain(d) => d.to_ascii_lowercase(),
            Host::Ipv4(ip) => ip.to_string(),
            Host::Ipv6(ip) => ip.to_string(),
        };
        if !allowed.iter().any(|a| a.eq_ignore_ascii_case(&name)) {
            return Err(format!("host `{name}` is not in `hooks.allowed_hosts`"));
        }
    }
    if team_hook && !settings.allow_private_networks {
        let literal = match host {
            Host::Ipv4(ip) => Some(IpAddr::V4(ip)),
            Host::Ipv6(ip) => Some(IpAddr::V6(ip)),
            Host::Domain(d)
                if {
                    // `localhost.` (the root's dot) names the same host.
                    let d = d.trim_end_matches('.').to_ascii_lowercase();
                    d == "localhost" || d.ends_with(".localhost")
                } =>
            {
                return Err("a team's hook may not target a loopback address".into());
            }
            Host::Domain(_) => None,
        };
        if let Some(ip) = literal
            && is_internal(ip)
        {
            return Err(format!(
                "a team's hook may not target {ip}, a loopback, private or link-local address"
            ));
        }
    }
    Ok(url)
}

/// Resolves like the system does, and refuses a name with any internal address.
pub(crate) struct PublicOnly;

impl Resolve for PublicOnly {
    fn resolve(&self, name: Name) -> Resolving {
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let addrs: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if let Some(bad) = addrs.iter().find(|a| is_internal(a.ip())) {
                return Err(format!(
                    "{host} resolves to {}, a loopback, private or link-local address",
                    bad.ip()
                )
                .into());
            }
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

/// The HTTP clients hooks are called with.
pub struct Caller {
    /// For server hooks, and team hooks when private networks are allowed.
    open: reqwest::Client,
    /// For team hooks: only public addresses.
    guarded: reqwest::Client,
    settings: HookSettings,
}

/// What one call got.
#[derive(Debug)]
pub struct Answer {
    pub status: Option<u16>,
    pub body: Vec<u8>,
    pub error: Option<String>,
    pub duration: Duration,
}

impl Answer {
    pub fn ok(&self) -> bool {
        self.error.is_none() && self.status.is_some_and(|s| (200..300).contains(&s))
    }

    /// Why the call failed, for a delivery's `error` and a `hook_failed` detail.
    pub fn why(&self) -> String {
        match (&self.error, self.status) {
            (Some(e), _) => e.clone(),
            (None, Some(s)) => format!("the receiver answered {s}"),
            (None, None) => "no answer".into(),
        }
    }
}

/// One request to send.
pub struct Request<'a> {
    pub url: &'a str,
    pub team_hook: bool,
    pub secret: &'a [u8],
    pub event: &'a str,
    pub delivery_id: &'a str,
    pub body: &'a str,
}

impl Caller {
    pub fn new(settings: &HookSettings) -> anyhow::Result<Self> {
        crate::telemetry::install_crypto_provider();
        let timeout = Duration::from_secs(settings.timeout_s);
        let base = || {
            reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .timeout(timeout)
                .connect_timeout(timeout.min(Duration::from_secs(10)))
                .user_agent(concat!("agentry-hooks/", env!("CARGO_PKG_VERSION")))
        };
        Ok(Self {
            open: base().build()?,
            // No proxy: a proxy would resolve the name itself, around `PublicOnly`.
            guarded: base()
                .no_proxy()
                .dns_resolver(Arc::new(PublicOnly))
                .build()?,
            settings: settings.clone(),
        })
    }

    pub fn settings(&self) -> &HookSettings {
        &self.settings
    }

    /// POST the body, signed; never follows a redirect; ends within `hooks.timeout_s`.
    pub async fn send(&self, req: &Request<'_>) -> Answer {
        let started = Instant::now();
        let failed = |e: String| Answer {
            status: None,
            body: Vec::new(),
            error: Some(e),
            duration: started.elapsed(),
        };
        // The address rule is checked again at call time: settings may have changed.
        if let Err(e) = check_url(req.url, req.team_hook, &self.settings) {
            return failed(e);
        }
        let guarded = req.team_hook && !self.settings.allow_private_networks;
        let client = if guarded { &self.guarded } else { &self.open };
        let timestamp = chrono::Utc::now().timestamp();
        let sent = client
            .post(req.url)
            .header("content-type", "application/json")
            .header("agentry-event", req.event)
            .header("agentry-delivery", req.delivery_id)
            .header("agentry-timestamp", timestamp.to_string())
            .header(
                "agentry-signature",
                signature(req.secret, timestamp, req.body.as_bytes()),
            )
            .body(req.body.to_owned())
            .send()
            .await;
        let res = match sent {
            Ok(r) => r,
            Err(e) if e.is_timeout() => {
                return failed(format!("no answer within {} s", self.settings.timeout_s));
            }
            Err(e) => return failed(describe(&e)),
        };
        let status = res.status().as_u16();
        let mut body = Vec::new();
        let mut stream = res.bytes_stream();
        let mut error = None;
        while let Some(chunk) = stream.next().await {
            match chunk {
                Ok(c) => {
                    if body.len() + c.len() > MAX_ANSWER_BYTES {
                        error = Some(format!(
                            "the answer is larger than {MAX_ANSWER_BYTES} bytes"
                        ));
                        break;
                    }
                    body.extend_from_slice(&c);
                }
                Err(e) if e.is_timeout() => {
                    error = Some(format!("no answer within {} s", self.settings.timeout_s));
                    break;
                }
                Err(e) => {
                    error = Some(describe(&e));
                    break;
                }
            }
        }
        Answer {
            status: Some(status),
            body,
            error,
            duration: started.elapsed(),
        }
    }
}

/// An error with its causes (reqwest's own message hides the resolver's reason).
fn describe(e: &reqwest::Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// Seconds to wait before attempt `attempts + 1`: 1, 2, 4, … capped at two minutes.
pub fn backoff_s(attempts: i32) -> f64 {
    let exp = attempts.clamp(1, 8) - 1;
    f64::from(1u32 << exp).min(120.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_is_hmac_sha256_of_timestamp_dot_body() {
        // Checked against `printf '%s' '1700000000.{"a":1}' | openssl dgst -sha256 -hmac s3cret`.
        assert_eq!(
            signature(b"s3cret", 1_700_000_000, br#"{"a":1}"#),
            "sha256=1698a50bc74d1ff1db85c4e0a5297c2ad9fdba245d5737cdb789e4cc6e098940"
        );
    }

    fn internal(ip: &str) -> bool {
        is_internal(ip.parse().unwrap())
    }

    #[test]
    fn internal_addresses_are_recognised() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "0.1.2.3",
            "255.255.255.255",
            "224.0.0.1",
            "::1",
            "::",
            "fe80::1",
            "fd00::1",
            "ff02::1",
        ] {
            assert!(internal(ip), "{ip}");
        }
        for ip in [
            "93.184.216.34",
            "2606:2800:220:1::1",
            "8.8.8.8",
            "100.63.255.255",
            "100.128.0.0",
            "198.17.255.255",
            "198.20.0.0",
            "223.255.255.254",
            "2001:db8::1",
            "2003::1",
            "::ffff:8.8.8.8",
        ] {
            assert!(!internal(ip), "{ip}");
        }
    }

    #[test]
    fn cgnat_is_internal() {
        assert!(internal("100.64.0.0"));
        assert!(internal("100.127.255.255"));
    }

    #[test]
    fn benchmarking_range_is_internal() {
        assert!(internal("198.18.0.1"));
        assert!(internal("198.19.255.255"));
    }

    #[test]
    fn reserved_class_e_is_internal() {
        assert!(internal("240.0.0.1"));
        assert!(internal("254.1.2.3"));
    }

    #[test]
    fn site_local_v6_is_internal() {
        assert!(internal("fec0::1"));
        assert!(internal("feff:ffff::1"));
    }

    #[test]
    fn nat64_prefixes_are_internal() {
        assert!(internal("64:ff9b::7f00:1"));
        assert!(internal("64:ff9b::a00:1"));
        assert!(internal("64:ff9b::808:808"), "refused whatever it carries");
        assert!(internal("64:ff9b:1::1"));
        assert!(internal("64:ff9b:1:ffff::1"));
        assert!(!internal("64:ff9b:2::1"));
    }

    #[test]
    fn six_to_four_is_internal() {
        assert!(internal("2002:7f00:1::1"));
        assert!(internal("2002:a9fe:a9fe::"));
        assert!(internal("2002:808:808::1"), "refused whatever it carries");
    }

    #[test]
    fn every_refused_v4_range_is_refused_in_its_v6_forms() {
        let v4s = [
            "127.0.0.1",
            "10.0.0.1",
            "172.16.0.1",
            "192.168.0.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "198.18.0.1",
            "240.0.0.1",
            "224.0.0.1",
            "255.255.255.255",
        ];
        for v4 in v4s {
            let a: std::net::Ipv4Addr = v4.parse().unwrap();
            let [b0, b1, b2, b3] = a.octets();
            let (hi, lo) = (u16::from_be_bytes([b0, b1]), u16::from_be_bytes([b2, b3]));
            for v6 in [
                format!("::ffff:{v4}"),
                format!("::{v4}"),
                format!("64:ff9b::{v4}"),
                format!("64:ff9b:1::{hi:x}:{lo:x}"),
                format!("2002:{hi:x}:{lo:x}::1"),
            ] {
                assert!(internal(&v6), "{v6} carries {v4}");
            }
        }
    }

    #[test]
    fn urls_are_checked_for_team_hooks() {
        let s = HookSettings::default();
        assert!(check_url("https://hooks.example.com/x", true, &s).is_ok());
        assert!(check_url("ftp://hooks.example.com/x", true, &s).is_err());
        assert!(check_url("http://127.0.0.1:9/x", true, &s).is_err());
        assert!(check_url("http://[::1]/x", true, &s).is_err());
        assert!(check_url("http://localhost/x", true, &s).is_err());
        assert!(check_url("http://localhost./x", true, &s).is_err());
        assert!(check_url("http://a.LOCALHOST./x", true, &s).is_err());
        assert!(check_url("http://127.0.0.1:9/x", false, &s).is_ok());
        let open = HookSettings {
            allow_private_networks: true,
            ..HookSettings::default()
        };
        assert!(check_url("http://127.0.0.1:9/x", true, &open).is_ok());
        let listed = HookSettings {
            allowed_hosts: Some(vec!["hooks.example.com".into()]),
            ..HookSettings::default()
        };
        assert!(check_url("https://HOOKS.example.com/x", true, &listed).is_ok());
        assert!(check_url("https://evil.example.com/x", true, &listed).is_err());
    }

    #[test]
    fn backoff_doubles_up_to_two_minutes() {
        assert_eq!(backoff_s(1), 1.0);
        assert_eq!(backoff_s(2), 2.0);
        assert_eq!(backoff_s(5), 16.0);
        assert_eq!(backoff_s(40), 120.0);
    }
}
