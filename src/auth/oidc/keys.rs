//! The identity provider's public keys (a JWKS) as `jsonwebtoken` decoding keys, and the
//! choice of a key for a token. A key fits only the algorithms of its own type and curve
//! (an RSA key never an EC or HMAC one) and the `alg` its JWK pins, so a token cannot
//! choose how its signature is checked.

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};
use serde::Deserialize;

/// One usable signing key from the JWKS.
#[derive(Clone)]
pub struct SigningKey {
    pub kid: Option<String>,
    /// The `alg` the JWK pins, when it names one.
    pub alg: Option<String>,
    kind: Kind,
    pub key: DecodingKey,
}

#[derive(Clone, Copy)]
enum Kind {
    Rsa,
    P256,
    P384,
    Ed25519,
}

#[derive(Deserialize)]
struct RawJwks {
    keys: Vec<serde_json::Value>,
}

/// Parse a JWKS document, keeping the signature keys this validator can use. Symmetric
/// (`oct`) keys, encryption keys and unknown key types are left out.
pub fn parse_jwks(body: &[u8]) -> Result<Vec<SigningKey>, String> {
    let raw: RawJwks =
        serde_json::from_slice(body).map_err(|e| format!("the JWKS is not valid JSON: {e}"))?;
    Ok(raw
        .keys
        .into_iter()
        .filter_map(|v| {
            let alg = v.get("alg").and_then(|a| a.as_str()).map(str::to_owned);
            let jwk: Jwk = serde_json::from_value(v).ok()?;
            if !matches!(
                jwk.common.public_key_use,
                None | Some(PublicKeyUse::Signature)
            ) {
                return None;
            }
            let kind = match &jwk.algorithm {
                AlgorithmParameters::RSA(_) => Kind::Rsa,
                AlgorithmParameters::EllipticCurve(p) => match p.curve {
                    EllipticCurve::P256 => Kind::P256,
                    EllipticCurve::P384 => Kind::P384,
                    _ => return None,
                },
                AlgorithmParameters::OctetKeyPair(p) if p.curve == EllipticCurve::Ed25519 => {
                    Kind::Ed25519
                }
                _ => return None,
            };
            Some(SigningKey {
                kid: jwk.common.key_id.clone(),
                alg,
                kind,
                key: DecodingKey::from_jwk(&jwk).ok()?,
            })
        })
        .collect())
}

impl SigningKey {
    /// This key can verify `alg` (its type and curve match, and the JWK does not pin
    /// another).
    pub fn fits(&self, alg: Algorithm) -> bool {
        use Algorithm::*;
        if self
            .alg
            .as_deref()
            .is_some_and(|a| a.parse::<Algorithm>().ok() != Some(alg))
        {
            return false;
        }
        match self.kind {
            Kind::Rsa => matches!(alg, RS256 | RS384 | RS512 | PS256 | PS384 | PS512),
            Kind::P256 => alg == ES256,
            Kind::P384 => alg == ES384,
            Kind::Ed25519 => alg == EdDSA,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_other_uses_and_types_are_left_out() {
        let jwks = br#"{"keys": [
            {"kty": "oct", "kid": "h", "k": "c2VjcmV0"},
            {"kty": "RSA", "kid": "enc", "use": "enc", "n": "AQAB", "e": "AQAB"},
            {"kty": "RSA", "kid": "r", "n": "AQAB", "e": "AQAB"},
            {"kty": "EC", "kid": "p", "crv": "P-256", "alg": "ES256", "x": "AQAB", "y": "AQAB"},
            {"kty": "OKP", "kid": "x", "crv": "X25519", "x": "AQAB"}
        ]}"#;
        let keys = parse_jwks(jwks).unwrap();
        let kids: Vec<_> = keys.iter().map(|k| k.kid.as_deref().unwrap()).collect();
        assert_eq!(kids, ["r", "p"]);
        let (r, p) = (&keys[0], &keys[1]);
        assert!(r.fits(Algorithm::RS256) && r.fits(Algorithm::PS512));
        assert!(!r.fits(Algorithm::HS256) && !r.fits(Algorithm::ES256));
        assert!(p.fits(Algorithm::ES256) && !p.fits(Algorithm::ES384));
        let pinned = SigningKey {
            alg: Some("PS256".into()),
            ..r.clone()
        };
        assert!(pinned.fits(Algorithm::PS256) && !pinned.fits(Algorithm::RS256));
    }
}
