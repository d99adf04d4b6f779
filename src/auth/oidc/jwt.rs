//! The checks around `jsonwebtoken` that it does not make itself (RFC 8725): the size
//! cap, `crit`, reading `alg` and `kid` to choose a key, `iat` in the future, time claims
//! of the wrong type; and the stable codes its errors answer. The signature and the
//! claims `exp`, `nbf`, `iss`, `aud` (with leeway) are `jsonwebtoken`'s.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{DecodingKey, Validation};
use serde_json::{Map, Value};

use crate::auth::AuthError;

/// Tokens larger than this are refused before any parsing.
pub const MAX_TOKEN_BYTES: usize = 16 * 1024;

/// What the header says, read before any key is chosen.
pub struct Header {
    pub alg: String,
    pub kid: Option<String>,
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

/// The size cap, three parts, a JSON header without `crit`, a string `alg` and `kid`.
pub fn header(token: &str) -> Result<Header, AuthError> {
    if token.len() > MAX_TOKEN_BYTES {
        return Err(AuthError::TokenTooLarge);
    }
    let malformed = AuthError::TokenMalformed;
    if token.split('.').count() != 3 {
        return Err(malformed("a JWT has three dot-separated parts"));
    }
    let h = token.split('.').next().unwrap_or_default();
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
    Ok(Header { alg, kid })
}

/// What the claims of a token must satisfy.
pub struct Expected<'a> {
    pub alg: jsonwebtoken::Algorithm,
    pub issuer: &'a str,
    /// The token's `aud` must contain at least one of these.
    pub audiences: &'a [String],
    pub leeway_s: u64,
}

/// Verify the signature with `key` and check the claims: `iss` exact, `aud` one of
/// ours, `exp` required and not past, `nbf` and `iat` not in the future (with leeway).
pub fn verify(
    token: &str,
    key: &DecodingKey,
    exp: &Expected<'_>,
) -> Result<Map<String, Value>, AuthError> {
    let mut v = Validation::new(exp.alg);
    v.leeway = exp.leeway_s;
    v.validate_nbf = true;
    v.set_issuer(&[exp.issuer]);
    v.set_audience(exp.audiences);
    v.set_required_spec_claims(&["exp", "iss", "aud"]);
    let claims = jsonwebtoken::decode::<Map<String, Value>>(token, key, &v)
        .map_err(|e| code(e.kind()))?
        .claims;
    let now = jsonwebtoken::get_current_timestamp();
    for name in ["nbf", "iat"] {
        match claims.get(name) {
            None => {}
            // jsonwebtoken 9 passes an `nbf` it cannot read; `iat` it does not check.
            Some(t) => match t.as_f64().filter(|f| f.is_finite()) {
                None => return Err(AuthError::TokenMalformed("a time claim is not a number")),
                Some(t) if t > now.saturating_add(exp.leeway_s) as f64 => {
                    return Err(AuthError::TokenNotYetValid);
                }
                Some(_) => {}
            },
        }
    }
    Ok(claims)
}

/// The stable code of a `jsonwebtoken` refusal.
fn code(kind: &ErrorKind) -> AuthError {
    match kind {
        ErrorKind::ExpiredSignature => AuthError::TokenExpired,
        ErrorKind::ImmatureSignature => AuthError::TokenNotYetValid,
        ErrorKind::InvalidIssuer => AuthError::TokenInvalidIssuer,
        ErrorKind::InvalidAudience => AuthError::TokenInvalidAudience,
        ErrorKind::MissingRequiredClaim(c) if c == "iss" => AuthError::TokenInvalidIssuer,
        ErrorKind::MissingRequiredClaim(c) if c == "aud" => AuthError::TokenInvalidAudience,
        ErrorKind::MissingRequiredClaim(_) => AuthError::TokenMalformed(
            "the token has no numeric `exp`; tokens without an expiry are refused",
        ),
        ErrorKind::InvalidAlgorithm | ErrorKind::MissingAlgorithm => {
            AuthError::TokenAlgorithmNotAllowed(
                "the key the token names does not sign with its `alg`".into(),
            )
        }
        ErrorKind::InvalidSignature
        | ErrorKind::InvalidEcdsaKey
        | ErrorKind::InvalidRsaKey(_)
        | ErrorKind::InvalidKeyFormat => AuthError::TokenInvalidSignature,
        _ => AuthError::TokenMalformed("the JWT is not base64url-encoded JSON"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{Algorithm, EncodingKey};
    use ring::signature::{Ed25519KeyPair, KeyPair};
    use serde_json::json;

    /// Sign `claims` with a fresh Ed25519 key; the token and the key that verifies it.
    fn signed(claims: Value) -> (String, DecodingKey) {
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&ring::rand::SystemRandom::new()).unwrap();
        let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).unwrap();
        let token = jsonwebtoken::encode(
            &jsonwebtoken::Header::new(Algorithm::EdDSA),
            &claims,
            &EncodingKey::from_ed_der(pkcs8.as_ref()),
        )
        .unwrap();
        (token, DecodingKey::from_ed_der(pair.public_key().as_ref()))
    }

    #[test]
    fn claims_are_checked_with_leeway_and_answer_their_codes() {
        let aud = vec!["agentry".to_owned()];
        let e = Expected {
            alg: Algorithm::EdDSA,
            issuer: "https://idp",
            audiences: &aud,
            leeway_s: 60,
        };
        let now = jsonwebtoken::get_current_timestamp() as i64;
        let check = |v: Value| {
            let (t, k) = signed(v);
            verify(&t, &k, &e)
        };
        let ok = json!({"iss": "https://idp", "aud": ["x", "agentry"], "exp": now + 30, "nbf": now + 30, "iat": now + 30});
        check(ok).unwrap();
        let code = |v: Value| check(v).unwrap_err().code();
        let base = |over: Value| {
            let mut c = json!({"iss": "https://idp", "aud": "agentry", "exp": now + 100});
            for (k, v) in over.as_object().unwrap() {
                c[k] = v.clone();
            }
            c
        };
        assert_eq!(
            code(base(json!({"iss": "https://idp/"}))),
            "token_invalid_issuer"
        );
        assert_eq!(code(base(json!({"iss": 7}))), "token_invalid_issuer");
        assert_eq!(
            code(base(json!({"aud": "other"}))),
            "token_invalid_audience"
        );
        assert_eq!(
            code(json!({"iss": "https://idp", "exp": now + 100})),
            "token_invalid_audience"
        );
        assert_eq!(
            code(json!({"iss": "https://idp", "aud": "agentry"})),
            "token_malformed"
        );
        assert_eq!(code(base(json!({"exp": "never"}))), "token_malformed");
        assert_eq!(code(base(json!({"exp": now - 100}))), "token_expired");
        assert_eq!(code(base(json!({"nbf": now + 100}))), "token_not_yet_valid");
        assert_eq!(code(base(json!({"iat": now + 100}))), "token_not_yet_valid");
        // A time claim of the wrong type is not skipped (CVE-2026-25537 in 9.x).
        assert_eq!(code(base(json!({"nbf": "99999999999"}))), "token_malformed");
        assert_eq!(code(base(json!({"iat": "soon"}))), "token_malformed");

        let (t, _) = signed(base(json!({})));
        let (_, other) = signed(base(json!({})));
        assert_eq!(
            verify(&t, &other, &e).unwrap_err().code(),
            "token_invalid_signature"
        );
    }

    #[test]
    fn only_three_part_tokens_with_a_json_header_are_read() {
        assert!(looks_like_jwt("eyJhbGciOiJub25lIn0.e30.x"));
        assert!(!looks_like_jwt("agt_pat_0123"));
        assert!(!looks_like_jwt("eyJ.a.b.c.d"));
        let h = header("eyJhbGciOiJub25lIn0.e30.").unwrap();
        assert_eq!(h.alg, "none");
        assert!(h.kid.is_none());
        assert_eq!(header("eyJ9.e30.").err().unwrap().code(), "token_malformed");
        let crit = format!(
            "{}.e30.",
            URL_SAFE_NO_PAD.encode(r#"{"alg":"RS256","crit":["exp"]}"#)
        );
        assert_eq!(header(&crit).err().unwrap().code(), "token_malformed");
        let big = format!("eyJhbGciOiJub25lIn0.{}.x", "a".repeat(MAX_TOKEN_BYTES));
        assert_eq!(header(&big).err().unwrap().code(), "token_too_large");
    }
}
