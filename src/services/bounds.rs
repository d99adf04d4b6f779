//! Bounds on what one caller or one team may hold at once on this server: open event
//! streams and running `wait`s per principal (a token or a session), and model catalog
//! refreshes per team. Counted in memory per replica; a slot is given back when its
//! holder is dropped. Persistent counts (agents, workspaces, projects) are counted in the
//! database by the services that create them, with `check_count`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::{ServiceError, ServiceResult};
use crate::config::{Limits, McpSettings};

/// What the bounds need: the limits, the MCP servers of the settings, and the counts.
pub struct Bounds {
    limits: Limits,
    pub mcp: McpSettings,
    streams: Counts,
    waits: Counts,
    refreshes: Mutex<HashMap<Uuid, Window>>,
}

type Counts = Arc<Mutex<HashMap<Uuid, usize>>>;

/// Refreshes started in the current minute.
struct Window {
    started: Instant,
    count: u32,
}

/// One held stream or `wait`; dropping it frees the slot.
pub struct Slot {
    counts: Counts,
    key: Uuid,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = counts.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.key);
            }
        }
    }
}

fn take(counts: &Counts, key: Uuid, max: usize, limit: &'static str) -> ServiceResult<Slot> {
    let mut held = counts.lock().unwrap_or_else(|p| p.into_inner());
    let n = held.entry(key).or_insert(0);
    if *n >= max {
        return Err(ServiceError::LimitReached {
            limit,
            value: max as u64,
        });
    }
    *n += 1;
    Ok(Slot {
        counts: counts.clone(),
        key,
    })
}

impl Bounds {
    pub fn new(limits: &Limits, mcp: &McpSettings) -> Self {
        Self {
            limits: limits.clone(),
            mcp: mcp.clone(),
            streams: Default::default(),
            waits: Default::default(),
            refreshes: Mutex::new(HashMap::new()),
        }
    }

    /// A slot for one more open event stream of the principal `key` (`principal_key`).
    pub fn stream(&self, key: Uuid) -> ServiceResult<Slot> {
        take(
            &self.streams,
            key,
            self.limits.max_streams_per_principal,
            "limits.max_streams_per_principal",
        )
    }

    /// A slot for one more running `wait` of the principal `key`.
    pub fn wait(&self, key: Uuid) -> ServiceResult<Slot> {
        take(
            &self.waits,
            key,
            self.limits.max_waits_per_principal,
            "limits.max_waits_per_principal",
        )
    }

    /// Whether `team` may start one more model catalog refresh now (counted when it may).
    pub fn refresh_allowed(&self, team: Uuid) -> bool {
        let max = self.limits.catalog_refreshes_per_minute;
        let mut windows = self.refreshes.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        windows.retain(|_, w| now.duration_since(w.started) < Duration::from_secs(60));
        let w = windows.entry(team).or_insert(Window {
            started: now,
            count: 0,
        });
        if w.count >= max {
            return false;
        }
        w.count += 1;
        true
    }
}

/// Whose count a caller's streams and `wait`s are: its API token, or — for a caller with
/// none behind it (an IdP bearer token, a browser session) — its user.
pub fn principal_key(principal: &crate::auth::Principal) -> Uuid {
    if principal.token_id.is_nil() {
        principal.user_id
    } else {
        principal.token_id
    }
}

/// Refuse one more of something a team has `count` of when `max` is its limit.
pub fn check_count(count: i64, max: i64, limit: &'static str) -> ServiceResult<()> {
    if count >= max {
        return Err(ServiceError::LimitReached {
            limit,
            value: max.max(0) as u64,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds(tweak: impl FnOnce(&mut Limits)) -> Bounds {
        let mut limits = Limits::default();
        tweak(&mut limits);
        Bounds::new(&limits, &McpSettings::default())
    }

    #[test]
    fn slots_are_counted_per_principal_and_given_back() {
        let b = bounds(|l| l.max_streams_per_principal = 2);
        let (me, you) = (Uuid::now_v7(), Uuid::now_v7());
        let first = b.stream(me).unwrap();
        let _second = b.stream(me).unwrap();
        let refused = b.stream(me).err().unwrap();
        assert_eq!(refused.code(), "limit_reached");
        assert!(
            refused
                .to_string()
                .contains("limits.max_streams_per_principal` (2)"),
            "{refused}"
        );
        assert!(b.stream(you).is_ok(), "another principal has its own count");
        drop(first);
        assert!(b.stream(me).is_ok(), "a closed stream frees its slot");
    }

    #[test]
    fn callers_without_a_token_count_as_their_user() {
        let mut p = crate::auth::Principal {
            user_id: Uuid::now_v7(),
            email: String::new(),
            name: String::new(),
            is_admin: false,
            token_id: Uuid::nil(),
            service_team: None,
            teams: Vec::new(),
            scopes: Vec::new(),
            request_id: None,
            agent: None,
        };
        assert_eq!(
            principal_key(&p),
            p.user_id,
            "not one count for every session"
        );
        p.token_id = Uuid::now_v7();
        assert_eq!(principal_key(&p), p.token_id);
    }

    #[test]
    fn refreshes_are_counted_per_team_per_minute() {
        let b = bounds(|l| l.catalog_refreshes_per_minute = 2);
        let (a, other) = (Uuid::now_v7(), Uuid::now_v7());
        assert!(b.refresh_allowed(a));
        assert!(b.refresh_allowed(a));
        assert!(!b.refresh_allowed(a));
        assert!(b.refresh_allowed(other));
    }
}
