//! API token material: generation, hashing and the recognisable prefix.

use rand::RngCore;
use sha2::{Digest, Sha256};

/// Every agentry personal or service token starts with this.
pub const TOKEN_PREFIX: &str = "agt_pat_";
/// How many characters of a token are kept (and shown) to recognise it.
pub const SHOWN_PREFIX_LEN: usize = 12;
const SECRET_HEX_LEN: usize = 64;

/// A fresh token: the prefix and 32 random bytes in hex.
pub fn generate() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!("{TOKEN_PREFIX}{}", hex::encode(bytes))
}

/// The SHA-256 hash a token is stored and looked up by.
pub fn hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

pub fn shown_prefix(token: &str) -> String {
    token.chars().take(SHOWN_PREFIX_LEN).collect()
}

/// Whether `token` has the shape of an agentry API token.
pub fn well_formed(token: &str) -> bool {
    token.strip_prefix(TOKEN_PREFIX).is_some_and(|rest| {
        rest.len() == SECRET_HEX_LEN && rest.bytes().all(|b| b.is_ascii_hexdigit())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_well_formed_and_hashed() {
        let a = generate();
        let b = generate();
        assert_ne!(a, b);
        assert!(well_formed(&a));
        assert!(!well_formed("agt_pat_short"));
        assert!(!well_formed(&a.replace("agt_pat_", "xyz_pat_")));
        assert_eq!(hash(&a).len(), 32);
        assert_ne!(hash(&a), hash(&b));
        assert_eq!(shown_prefix(&a).len(), SHOWN_PREFIX_LEN);
    }
}
