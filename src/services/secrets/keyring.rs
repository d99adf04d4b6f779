//! The keys that encrypt team secrets at rest, and the cipher: AES-256-GCM with a fresh
//! random 96-bit nonce per value and the team id and secret name as associated data, so
//! that a sealed value only opens for the row it was written to. Each key is known by an
//! id (a fingerprint: the first 8 bytes of a SHA-256 over the key, in hex) that is stored
//! beside every value, so a value sealed under a previous key still opens, and
//! `agentry secrets rotate` finds what to re-encrypt.

use std::fmt;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use anyhow::Context;
use base64::Engine;
use rand::{RngCore, TryRngCore};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::config::{Secret, SecretsSettings, decode_secrets_key};
use crate::domain::SecretValue;

/// The file that holds the key the server generated for itself when none is configured.
pub const GENERATED_KEY_FILE: &str = "secrets-key";

/// Associated data prefix: binds a value to this use and format version.
const AAD_CONTEXT: &[u8] = b"agentry team secret v1\0";

/// One AES-256 key with its id.
struct Key {
    id: String,
    cipher: Aes256Gcm,
}

impl Key {
    fn new(bytes: &[u8; 32]) -> Self {
        Self {
            id: key_id(bytes),
            cipher: Aes256Gcm::new(bytes.into()),
        }
    }
}

/// The id of a key: hex of the first 8 bytes of SHA-256("agentry secrets key id\0" || key).
/// It names the key in rows and logs without revealing anything usable about it.
pub fn key_id(key: &[u8; 32]) -> String {
    let digest = Sha256::new()
        .chain_update(b"agentry secrets key id\0")
        .chain_update(key)
        .finalize();
    hex::encode(&digest[..8])
}

/// A value as stored: which key sealed it, its nonce, the ciphertext with its tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    pub key_id: String,
    pub nonce: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

/// Why a stored value could not be opened. Never carries the value or key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    #[error(
        "it was encrypted under key {0}, which this server does not have (add that key to \
         `secrets.previous_keys`, or set the secret again)"
    )]
    UnknownKey(String),
    #[error(
        "its stored ciphertext does not authenticate for this team and name (the row was \
         altered or copied from elsewhere); set the secret again"
    )]
    Rejected,
}

/// Where the current key came from (for the start-up log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// `secrets.key` in the settings or `AGENTRY_SECRETS__KEY`.
    Settings,
    /// A key this server generated earlier, read from this file.
    File(PathBuf),
    /// Generated on this start and written to this file.
    Generated(PathBuf),
}

/// The current key (seals and opens) and the previous ones (open only).
pub struct Keyring {
    current: Key,
    previous: Vec<Key>,
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keyring")
            .field("current", &self.current.id)
            .field(
                "previous",
                &self.previous.iter().map(|k| &k.id).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Keyring {
    pub fn new(current: &[u8; 32], previous: &[[u8; 32]]) -> Self {
        let current = Key::new(current);
        let mut keys: Vec<Key> = Vec::new();
        for bytes in previous {
            let key = Key::new(bytes);
            if key.id != current.id && !keys.iter().any(|k| k.id == key.id) {
                keys.push(key);
            }
        }
        Self {
            current,
            previous: keys,
        }
    }

    /// The keyring of `[secrets]`: `key`, else the key in `<data_dir>/secrets-key`, which
    /// is generated (32 random bytes, base64, mode 0600) when it does not exist yet.
    pub fn from_settings(
        settings: &SecretsSettings,
        data_dir: &Path,
    ) -> anyhow::Result<(Self, KeySource)> {
        let decode = |setting: &str, key: &Secret| {
            decode_secrets_key(key).map_err(|m| anyhow::anyhow!("invalid setting `{setting}`: {m}"))
        };
        let mut previous = Vec::with_capacity(settings.previous_keys.len());
        for (i, key) in settings.previous_keys.iter().enumerate() {
            previous.push(decode(&format!("secrets.previous_keys[{i}]"), key)?);
        }
        let (current, source) = match &settings.key {
            Some(key) => (decode("secrets.key", key)?, KeySource::Settings),
            None => generated_key(data_dir)?,
        };
        Ok((Self::new(&current, &previous), source))
    }

    /// The id of the key new values are sealed under.
    pub fn current_id(&self) -> &str {
        &self.current.id
    }

    /// Seal `value` for `name` of `team` under the current key, with a fresh nonce.
    pub fn seal(&self, team: Uuid, name: &str, value: &SecretValue) -> Sealed {
        let mut nonce = [0u8; 12];
        rand::rng().fill_bytes(&mut nonce);
        let aad = associated_data(team, name);
        let ciphertext = self
            .current
            .cipher
            .encrypt(
                &Nonce::from(nonce),
                Payload {
                    msg: value.expose().as_bytes(),
                    aad: &aad,
                },
            )
            .expect("AES-GCM encrypts any message shorter than 64 GiB");
        Sealed {
            key_id: self.current.id.clone(),
            nonce: nonce.to_vec(),
            ciphertext,
        }
    }

    /// Open a value stored for `name` of `team`.
    pub fn open(&self, team: Uuid, name: &str, sealed: &Sealed) -> Result<SecretValue, OpenError> {
        let key = std::iter::once(&self.current)
            .chain(&self.previous)
            .find(|k| k.id == sealed.key_id)
            .ok_or_else(|| OpenError::UnknownKey(sealed.key_id.clone()))?;
        let nonce: [u8; 12] = sealed
            .nonce
            .as_slice()
            .try_into()
            .map_err(|_| OpenError::Rejected)?;
        let aad = associated_data(team, name);
        let plain = key
            .cipher
            .decrypt(
                &Nonce::from(nonce),
                Payload {
                    msg: &sealed.ciphertext,
                    aad: &aad,
                },
            )
            .map_err(|_| OpenError::Rejected)?;
        String::from_utf8(plain)
            .map(SecretValue::new)
            .map_err(|_| OpenError::Rejected)
    }
}

fn associated_data(team: Uuid, name: &str) -> Vec<u8> {
    let mut aad = Vec::with_capacity(AAD_CONTEXT.len() + 16 + name.len());
    aad.extend_from_slice(AAD_CONTEXT);
    aad.extend_from_slice(team.as_bytes());
    aad.extend_from_slice(name.as_bytes());
    aad
}

/// The key in `<data_dir>/secrets-key`, generated when the file does not exist.
fn generated_key(data_dir: &Path) -> anyhow::Result<([u8; 32], KeySource)> {
    let path = data_dir.join(GENERATED_KEY_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let key = decode_secrets_key(&Secret::new(text)).map_err(|m| {
                anyhow::anyhow!(
                    "the team secrets key in {} {m}; restore the file from a backup or set \
                     `secrets.key`",
                    path.display()
                )
            })?;
            return Ok((key, KeySource::File(path)));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(e).with_context(|| format!("cannot read {}", path.display()));
        }
    }
    let mut key = [0u8; 32];
    rand::rngs::OsRng
        .try_fill_bytes(&mut key)
        .map_err(|e| anyhow::anyhow!("the system's random source failed: {e}"))?;
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("cannot create data_dir {}", data_dir.display()))?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    writeln!(
        file,
        "{}",
        base64::engine::general_purpose::STANDARD.encode(key)
    )
    .and_then(|_| file.sync_all())
    .with_context(|| format!("cannot write {}", path.display()))?;
    Ok((key, KeySource::Generated(path)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> [u8; 32] {
        [n; 32]
    }

    #[test]
    fn a_sealed_value_opens_for_its_row_only() {
        let ring = Keyring::new(&key(1), &[]);
        let (team, other) = (Uuid::now_v7(), Uuid::now_v7());
        let value = SecretValue::new("sk-ant-12345");
        let sealed = ring.seal(team, "ANTHROPIC_API_KEY", &value);
        assert_eq!(sealed.key_id, ring.current_id());
        assert_eq!(sealed.nonce.len(), 12);
        assert!(
            !sealed
                .ciphertext
                .windows(value.expose().len())
                .any(|w| w == value.expose().as_bytes())
        );
        assert_eq!(
            ring.open(team, "ANTHROPIC_API_KEY", &sealed).unwrap(),
            value
        );
        // Another team, another name: the associated data differs.
        assert_eq!(
            ring.open(other, "ANTHROPIC_API_KEY", &sealed),
            Err(OpenError::Rejected)
        );
        assert_eq!(
            ring.open(team, "OPENAI_API_KEY", &sealed),
            Err(OpenError::Rejected)
        );
        // A flipped bit anywhere.
        let mut tampered = sealed.clone();
        tampered.ciphertext[0] ^= 1;
        assert_eq!(
            ring.open(team, "ANTHROPIC_API_KEY", &tampered),
            Err(OpenError::Rejected)
        );
        let mut tampered = sealed.clone();
        tampered.nonce[11] ^= 1;
        assert_eq!(
            ring.open(team, "ANTHROPIC_API_KEY", &tampered),
            Err(OpenError::Rejected)
        );
    }

    #[test]
    fn every_value_gets_its_own_nonce() {
        let ring = Keyring::new(&key(1), &[]);
        let team = Uuid::now_v7();
        let v = SecretValue::new("same");
        let a = ring.seal(team, "K", &v);
        let b = ring.seal(team, "K", &v);
        assert_ne!(a.nonce, b.nonce);
        assert_ne!(a.ciphertext, b.ciphertext);
    }

    #[test]
    fn previous_keys_open_and_unknown_keys_are_named() {
        let team = Uuid::now_v7();
        let old = Keyring::new(&key(1), &[]);
        let sealed = old.seal(team, "K", &SecretValue::new("v"));
        let rotated = Keyring::new(&key(2), &[key(1)]);
        assert_eq!(rotated.open(team, "K", &sealed).unwrap().expose(), "v");
        assert_ne!(rotated.current_id(), old.current_id());
        let resealed = rotated.seal(team, "K", &SecretValue::new("v"));
        assert_eq!(resealed.key_id, rotated.current_id());

        let without = Keyring::new(&key(2), &[]);
        let e = without.open(team, "K", &sealed).unwrap_err();
        assert_eq!(e, OpenError::UnknownKey(old.current_id().to_owned()));
        assert!(e.to_string().contains(old.current_id()), "{e}");
        // Ids are stable and do not show the key.
        assert_eq!(key_id(&key(1)), old.current_id());
        assert_eq!(old.current_id().len(), 16);
        assert!(!format!("{rotated:?}").contains("0101"));
    }

    #[test]
    fn without_a_configured_key_one_is_generated_once_with_mode_0600() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let settings = SecretsSettings::default();
        let (first, source) = Keyring::from_settings(&settings, dir.path()).unwrap();
        let path = dir.path().join(GENERATED_KEY_FILE);
        assert_eq!(source, KeySource::Generated(path.clone()));
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let (again, source) = Keyring::from_settings(&settings, dir.path()).unwrap();
        assert_eq!(source, KeySource::File(path.clone()));
        assert_eq!(first.current_id(), again.current_id());

        // A configured key wins over the file.
        let configured = SecretsSettings {
            key: Some(Secret::new(
                base64::engine::general_purpose::STANDARD.encode(key(7)),
            )),
            previous_keys: Vec::new(),
        };
        let (ring, source) = Keyring::from_settings(&configured, dir.path()).unwrap();
        assert_eq!(source, KeySource::Settings);
        assert_eq!(ring.current_id(), key_id(&key(7)));

        // A damaged file is refused, naming it.
        std::fs::write(&path, "not a key").unwrap();
        let e = Keyring::from_settings(&settings, dir.path()).unwrap_err();
        assert!(e.to_string().contains("secrets-key"), "{e}");
    }
}
