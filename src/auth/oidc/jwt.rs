//! Compact JWS parsing and the claim checks of RFC 8725: the header is read only to learn
//! the algorithm and the key id; the payload is trusted only after its signature verified.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde_json::{Map, Value};

use crate::auth::AuthError;

/// Tokens larger than this are refused before any parsing.
pub const MAX_TOKEN_BYTES: usize = 16 * 1024;

/// The parts of a compact JWS, split and decoded but not verified.
pub struct Unverified<'a> {
    /// `<header>.<payload>` as sent: the bytes the signature covers.
    pub signing_input: &'a str,
    pub alg: String,
    pub kid: Option<String>,
    payload_b64: &'a str,
    pub signature: Vec<u8>,
}

/// Whether `token` has the shape of a JWT (three base64url parts, a JSON header), so it
/// is meant for the OIDC validator rather than the API token lookup.
pub fn looks_like_jwt(token: &str) -> bool {
    let parts: Vec<&str> = token.split('.').collect();
    parts.len() == 3
        && parts[0].starts_with("eyJ")
        && parts.iter().all(|p| {
            p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

pub fn split(token: &str) -> Result<Unverified<'_>, AuthError> {
    if token.len() > MAX_TOKEN_BYTES {
        return Err(AuthError::TokenTooLarge);
    }
    let malformed = AuthError::TokenMalformed;
    let mut parts = token.split('.');
    let (Some(h), Some(p), Some(s), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(malformed("a JWT has three dot-separated parts"));
    };
    let header: Map<String, Value> = URL_SAFE_NO_PAD
        .decode(h)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or(malformed("the JWT header is not base64url-encoded JSON"))?;
    if header.contains_key("crit") {
        return Err(malformed(
            "the JWT header has `crit` extensions this server does not implement",
        ));
    }
    let alg = header
        .get("alg")
        .and_then(Value::as_str)
        .ok_or(malformed("the JWT header has no `alg`"))?
        .to_owned();
    let kid = match header.get("kid") {
        None => None,
        Some(Value::String(k)) => Some(k.clone()),
        Some(_) => return Err(malformed("the JWT header's `kid` is not a string")),
    };
    let signature = URL_SAFE_NO_PAD
        .decode(s)
        .map_err(|_| malformed("the JWT signature is not base64url"))?;
    Ok(Unverified {
        signing_input: &token[..h.len() + 1 + p.len()],
        alg,
        kid,
        payload_b64: p,
        signature,
    })
}

impl Unverified<'_> {
    /// The claims; call only after the signature verified.
    pub fn claims(&self) -> Result<Map<String, Value>, AuthError> {
        URL_SAFE_NO_PAD
            .decode(self.payload_b64)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or(AuthError::TokenMalformed(
                "the JWT payload is not base64url-encoded JSON",
            ))
    }
}

/// What the claims of a verified token must satisfy.
pub struct Expected<'a> {
    pub issuer: &'a str,
    /// The token's `aud` must contain at least one of these.
    pub audiences: &'a [String],
    pub leeway_s: i64,
    /// Seconds since the epoch.
    pub now: i64,
}

/// `iss` exact, `aud` one of ours, `exp` required and not past, `nbf` and `iat` not in
/// the future (all with leeway).
pub fn check_claims(claims: &Map<String, Value>, exp: &Expected<'_>) -> Result<(), AuthError> {
    if claims.get("iss").and_then(Value::as_str) != Some(exp.issuer) {
        return Err(AuthError::TokenInvalidIssuer);
    }
    let aud_ok = match claims.get("aud") {
        Some(Value::String(a)) => exp.audiences.iter().any(|x| x == a),
        Some(Value::Array(list)) => list
            .iter()
            .filter_map(Value::as_str)
            .any(|a| exp.audiences.iter().any(|x| x == a)),
        _ => false,
    };
    if !aud_ok {
        return Err(AuthError::TokenInvalidAudience);
    }
    let time = |name: &'static str| -> Result<Option<i64>, AuthError> {
        match claims.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|f| f.is_finite())
                .map(|f| Some(f as i64))
                .ok_or(AuthError::TokenMalformed("a time claim is not a number")),
        }
    };
    let expires = time("exp")?.ok_or(AuthError::TokenMalformed(
        "the token has no `exp`; tokens without an expiry are refused",
    ))?;
    if exp.now > expires.saturating_add(exp.leeway_s) {
        return Err(AuthError::TokenExpired);
    }
    for name in ["nbf", "iat"] {
        if let Some(t) = time(name)?
            && t > exp.now.saturating_add(exp.leeway_s)
        {
            return Err(AuthError::TokenNotYetValid);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claims(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn claims_are_checked_with_leeway() {
        let aud = vec!["agentry".to_owned()];
        let e = Expected {
            issuer: "https://idp",
            audiences: &aud,
            leeway_s: 60,
            now: 1_000_000,
        };
        let ok = json!({"iss": "https://idp", "aud": ["x", "agentry"], "exp": 1_000_030, "nbf": 1_000_030});
        check_claims(&claims(ok), &e).unwrap();
        let code = |v: Value| check_claims(&claims(v), &e).unwrap_err().code();
        assert_eq!(
            code(json!({"iss": "https://idp/", "aud": "agentry", "exp": 1_000_100})),
            "token_invalid_issuer"
        );
        assert_eq!(
            code(json!({"iss": "https://idp", "aud": "other", "exp": 1_000_100})),
            "token_invalid_audience"
        );
        assert_eq!(
            code(json!({"iss": "https://idp", "aud": "agentry"})),
            "token_malformed"
        );
        assert_eq!(
            code(json!({"iss": "https://idp", "aud": "agentry", "exp": 999_900})),
            "token_expired"
        );
        assert_eq!(
            code(
                json!({"iss": "https://idp", "aud": "agentry", "exp": 1_000_900, "nbf": 1_000_100})
            ),
            "token_not_yet_valid"
        );
        assert_eq!(
            code(
                json!({"iss": "https://idp", "aud": "agentry", "exp": 1_000_900, "iat": 1_000_100})
            ),
            "token_not_yet_valid"
        );
    }

    #[test]
    fn only_three_part_tokens_with_a_json_header_split() {
        assert!(looks_like_jwt("eyJhbGciOiJub25lIn0.e30.x"));
        assert!(!looks_like_jwt("agt_pat_0123"));
        assert!(!looks_like_jwt("eyJ.a.b.c.d"));
        let u = split("eyJhbGciOiJub25lIn0.e30.").unwrap();
        assert_eq!(u.alg, "none");
        assert!(u.signature.is_empty());
        assert_eq!(split("eyJ9.e30.").err().unwrap().code(), "token_malformed");
        let big = format!("eyJhbGciOiJub25lIn0.{}.x", "a".repeat(MAX_TOKEN_BYTES));
        assert_eq!(split(&big).err().unwrap().code(), "token_too_large");
    }
}
