//! Principals of API tokens seen recently, so a busy client's requests do not each read
//! its token, its user and their teams. What could change a principal — a token revoked,
//! a member added, removed or given another role, a user or team changed — fires a
//! trigger that sends `NOTIFY agentry_auth` when it commits (migration 0014), whichever
//! replica or tool wrote it; every replica listening forgets every principal it holds.
//! While a replica does not listen (starting, or after its listening connection was
//! lost) it holds nothing and reads each token again. A service that makes such a change
//! also calls `forget_all` once it has committed, so its own replica does not wait for
//! the notification. An entry is also dropped after `MAX_AGE`, and a token's expiry is
//! checked on every use.
//!
//! Every such change is also announced to this replica's open event streams and waits
//! (`changes`): each checks its caller again and ends when the caller lost the right to
//! it. Migration 0017 adds browser sessions (revoked, cut short, deleted) to what
//! notifies.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio::sync::watch;

use super::Principal;
use crate::metrics::{Counter, Family};
use crate::store;

/// The channel the triggers of migration 0014 notify.
pub const CHANNEL: &str = "agentry_auth";

/// How long a principal is used before its token is read again, notification or not.
pub const MAX_AGE: Duration = Duration::from_secs(60);

/// How many tokens are held at most; past it, a token is read each time until the next
/// change or `MAX_AGE` empties the cache.
const CAPACITY: usize = 10_000;

/// A token's SHA-256 hash: the key, so the cache never holds a token itself.
pub type TokenHash = [u8; 32];

pub struct TokenCache {
    entries: Mutex<HashMap<TokenHash, Entry>>,
    /// Whether this replica listens for changes now; nothing is held while it does not.
    listening: AtomicBool,
    /// Bumped by every `forget_all`: a principal read before a change is not kept after it.
    generation: AtomicU64,
    /// Tokens resolved, by `source`: `held` here or `read` from the database.
    pub lookups: Family<Counter>,
    held: Arc<Counter>,
    read: Arc<Counter>,
    /// Counts every `forget_all`: open streams and waits watch it to check their caller.
    changed: watch::Sender<u64>,
}

#[derive(Clone)]
pub(super) struct Entry {
    pub principal: Principal,
    pub expires_at: Option<DateTime<Utc>>,
    /// When the token's use was last recorded (or found recorded).
    pub used_at: Option<DateTime<Utc>>,
    pub stored: Instant,
}

impl Default for TokenCache {
    fn default() -> Self {
        let lookups = Family::counters(&["source"]);
        Self {
            entries: Mutex::new(HashMap::new()),
            listening: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            held: lookups.with(&["held"]),
            read: lookups.with(&["read"]),
            lookups,
            changed: watch::Sender::new(0),
        }
    }
}

impl TokenCache {
    /// The generation to hand back to `keep` with a principal read now.
    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// The principal held for `hash`, if it is fresh.
    pub(super) fn get(&self, hash: &TokenHash) -> Option<Entry> {
        if !self.listening.load(Ordering::SeqCst) {
            self.read.inc();
            return None;
        }
        let mut entries = self.entries.lock().unwrap();
        match entries.get(hash) {
            Some(e) if e.stored.elapsed() < MAX_AGE => {
                self.held.inc();
                Some(e.clone())
            }
            Some(_) => {
                entries.remove(hash);
                self.read.inc();
                None
            }
            None => {
                self.read.inc();
                None
            }
        }
    }

    /// Hold `entry`, read at `generation`, unless something changed since.
    pub(super) fn keep(&self, hash: TokenHash, entry: Entry, generation: u64) {
        if !self.listening.load(Ordering::SeqCst) {
            return;
        }
        let mut entries = self.entries.lock().unwrap();
        // Checked under the lock `forget_all` takes: a change after the read empties the
        // map after this insert, or bumped the generation before it.
        if self.generation.load(Ordering::SeqCst) != generation {
            return;
        }
        if entries.len() >= CAPACITY && !entries.contains_key(&hash) {
            return;
        }
        entries.insert(hash, entry);
    }

    /// Record that the use of `hash`'s token was just recorded.
    pub(super) fn used(&self, hash: &TokenHash, at: DateTime<Utc>) {
        if let Some(e) = self.entries.lock().unwrap().get_mut(hash) {
            e.used_at = Some(at);
        }
    }

    /// Forget every principal: something that may change one has committed.
    pub fn forget_all(&self) {
        let mut entries = self.entries.lock().unwrap();
        self.generation.fetch_add(1, Ordering::SeqCst);
        entries.clear();
        drop(entries);
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Forget the principal of `token`, so that its next use reads it from the store.
    pub fn forget_token(&self, token: &str) {
        let hash = super::tokens::hash(token);
        self.entries.lock().unwrap().remove(&hash);
    }

    /// Changes that may affect a principal, as they are heard (or made here): whoever
    /// holds a principal for long checks it again when this changes.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Start or stop holding principals; either way, what is held now is forgotten and
    /// what is being read now is not kept.
    fn set_listening(&self, on: bool) {
        self.listening.store(on, Ordering::SeqCst);
        self.forget_all();
    }

    /// Listen for changes until the process ends, reconnecting when the connection is
    /// lost; principals are held only while a connection listens.
    pub async fn listen(&self, pool: PgPool) {
        loop {
            let mut listener = store::listener(&pool, CHANNEL, "token changes").await;
            self.set_listening(true);
            // `Ok(None)` or an error: the connection is lost.
            while let Ok(Some(_)) = listener.try_recv().await {
                self.forget_all();
            }
            // Changes are not heard until a new connection listens: hold nothing till then.
            self.set_listening(false);
            tracing::warn!("the connection listening for token changes was lost; reconnecting");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> Entry {
        Entry {
            principal: Principal {
                user_id: uuid::Uuid::nil(),
                email: "a@example.com".into(),
                name: "A".into(),
                is_admin: false,
                token_id: uuid::Uuid::nil(),
                service_team: None,
                teams: vec![],
                scopes: vec![],
                request_id: None,
                agent: None,
            },
            expires_at: None,
            used_at: None,
            stored: Instant::now(),
        }
    }

    #[test]
    fn nothing_is_held_while_nobody_listens() {
        let cache = TokenCache::default();
        let g = cache.generation();
        cache.keep([1; 32], entry(), g);
        assert!(cache.get(&[1; 32]).is_none());
        cache.set_listening(true);
        let g = cache.generation();
        cache.keep([1; 32], entry(), g);
        assert!(cache.get(&[1; 32]).is_some());
        cache.set_listening(false);
        assert!(cache.get(&[1; 32]).is_none());
        assert!(cache.entries.lock().unwrap().is_empty());
    }

    #[test]
    fn a_principal_read_before_a_change_is_not_kept_after_it() {
        let cache = TokenCache::default();
        cache.set_listening(true);
        let before = cache.generation();
        cache.forget_all();
        cache.keep([2; 32], entry(), before);
        assert!(cache.get(&[2; 32]).is_none());
        let now = cache.generation();
        cache.keep([2; 32], entry(), now);
        assert!(cache.get(&[2; 32]).is_some());
        cache.forget_all();
        assert!(cache.get(&[2; 32]).is_none());
    }

    #[test]
    fn every_change_is_announced_to_watchers() {
        let cache = TokenCache::default();
        let mut rx = cache.changes();
        assert!(!rx.has_changed().unwrap());
        cache.forget_all();
        assert!(rx.has_changed().unwrap());
        rx.mark_unchanged();
        cache.set_listening(true);
        assert!(rx.has_changed().unwrap());
    }

    #[test]
    fn an_old_principal_is_read_again() {
        let cache = TokenCache::default();
        cache.set_listening(true);
        let mut old = entry();
        old.stored = Instant::now()
            .checked_sub(MAX_AGE + Duration::from_secs(1))
            .expect("a machine up for more than a minute");
        cache.keep([3; 32], old, cache.generation());
        assert!(cache.get(&[3; 32]).is_none());
        assert!(cache.entries.lock().unwrap().is_empty());
    }
}
