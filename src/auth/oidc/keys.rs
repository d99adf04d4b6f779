//! The identity provider's public keys (a JWKS) and signature verification with them.
//! A key verifies only the algorithms of its own family — an RSA key never verifies an
//! EC or HMAC signature — so a token cannot choose how its signature is checked.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::signature::{self, RsaPublicKeyComponents, UnparsedPublicKey};
use serde::Deserialize;

/// One usable signing key from the JWKS.
#[derive(Clone)]
pub struct SigningKey {
    pub kid: Option<String>,
    /// The `alg` the JWK pins, when it names one.
    pub alg: Option<String>,
    material: Material,
}

#[derive(Clone)]
enum Material {
    Rsa {
        n: Vec<u8>,
        e: Vec<u8>,
    },
    /// An uncompressed point (0x04 || x || y) on `crv`.
    Ec {
        crv: &'static str,
        point: Vec<u8>,
    },
    Ed25519(Vec<u8>),
}

#[derive(Deserialize)]
struct RawJwks {
    keys: Vec<serde_json::Value>,
}

#[derive(Deserialize)]
struct RawJwk {
    kty: String,
    kid: Option<String>,
    alg: Option<String>,
    #[serde(rename = "use")]
    use_: Option<String>,
    n: Option<String>,
    e: Option<String>,
    crv: Option<String>,
    x: Option<String>,
    y: Option<String>,
}

/// Parse a JWKS document, keeping the signature keys this validator can use. Symmetric
/// (`oct`) keys, encryption keys and unknown key types are left out.
pub fn parse_jwks(body: &[u8]) -> Result<Vec<SigningKey>, String> {
    let raw: RawJwks =
        serde_json::from_slice(body).map_err(|e| format!("the JWKS is not valid JSON: {e}"))?;
    Ok(raw
        .keys
        .into_iter()
        .filter_map(|v| serde_json::from_value::<RawJwk>(v).ok())
        .filter(|k| k.use_.as_deref().is_none_or(|u| u == "sig"))
        .filter_map(|k| {
            let b64 =
                |v: &Option<String>| v.as_deref().and_then(|s| URL_SAFE_NO_PAD.decode(s).ok());
            let material = match k.kty.as_str() {
                "RSA" => Material::Rsa {
                    n: b64(&k.n)?,
                    e: b64(&k.e)?,
                },
                "EC" => {
                    let (crv, len) = match k.crv.as_deref()? {
                        "P-256" => ("P-256", 32),
                        "P-384" => ("P-384", 48),
                        _ => return None,
                    };
                    let (x, y) = (b64(&k.x)?, b64(&k.y)?);
                    if x.len() != len || y.len() != len {
                        return None;
                    }
                    let mut point = Vec::with_capacity(1 + 2 * len);
                    point.push(0x04);
                    point.extend_from_slice(&x);
                    point.extend_from_slice(&y);
                    Material::Ec { crv, point }
                }
                "OKP" if k.crv.as_deref() == Some("Ed25519") => Material::Ed25519(b64(&k.x)?),
                _ => return None,
            };
            Some(SigningKey {
                kid: k.kid,
                alg: k.alg,
                material,
            })
        })
        .collect())
}

impl SigningKey {
    /// This key can verify `alg` (its family matches, and the JWK does not pin another).
    pub fn fits(&self, alg: &str) -> bool {
        if self.alg.as_deref().is_some_and(|a| a != alg) {
            return false;
        }
        match &self.material {
            Material::Rsa { .. } => matches!(
                alg,
                "RS256" | "RS384" | "RS512" | "PS256" | "PS384" | "PS512"
            ),
            Material::Ec { crv, .. } => {
                (alg == "ES256" && *crv == "P-256") || (alg == "ES384" && *crv == "P-384")
            }
            Material::Ed25519(_) => alg == "EdDSA",
        }
    }

    /// Verify `sig` over `message` with `alg`; false for any algorithm this key does not
    /// fit.
    pub fn verify(&self, alg: &str, message: &[u8], sig: &[u8]) -> bool {
        if !self.fits(alg) {
            return false;
        }
        match &self.material {
            Material::Rsa { n, e } => {
                let params: &signature::RsaParameters = match alg {
                    "RS256" => &signature::RSA_PKCS1_2048_8192_SHA256,
                    "RS384" => &signature::RSA_PKCS1_2048_8192_SHA384,
                    "RS512" => &signature::RSA_PKCS1_2048_8192_SHA512,
                    "PS256" => &signature::RSA_PSS_2048_8192_SHA256,
                    "PS384" => &signature::RSA_PSS_2048_8192_SHA384,
                    "PS512" => &signature::RSA_PSS_2048_8192_SHA512,
                    _ => return false,
                };
                RsaPublicKeyComponents { n, e }
                    .verify(params, message, sig)
                    .is_ok()
            }
            Material::Ec { point, .. } => {
                let algorithm: &dyn signature::VerificationAlgorithm = match alg {
                    "ES256" => &signature::ECDSA_P256_SHA256_FIXED,
                    "ES384" => &signature::ECDSA_P384_SHA384_FIXED,
                    _ => return false,
                };
                UnparsedPublicKey::new(algorithm, point)
                    .verify(message, sig)
                    .is_ok()
            }
            Material::Ed25519(x) => UnparsedPublicKey::new(&signature::ED25519, x)
                .verify(message, sig)
                .is_ok(),
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
            {"kty": "EC", "kid": "bad-len", "crv": "P-256", "x": "AQAB", "y": "AQAB"},
            {"kty": "OKP", "kid": "x", "crv": "X25519", "x": "AQAB"}
        ]}"#;
        let keys = parse_jwks(jwks).unwrap();
        assert_eq!(keys.len(), 1);
        let k = &keys[0];
        assert_eq!(k.kid.as_deref(), Some("r"));
        assert!(k.fits("RS256") && k.fits("PS512"));
        assert!(!k.fits("HS256") && !k.fits("ES256") && !k.fits("none"));
        assert!(!k.verify("HS256", b"m", b"s"));
    }
}
