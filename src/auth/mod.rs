//! Who is calling and what they may touch. API tokens (`agt_pat_…`, random, stored as a
//! SHA-256 hash, revocable, expiring) resolve to a `Principal`: a user with their team
//! memberships, or a team service token acting with one role. Handlers take `Principal`
//! as an extractor, so no `/v1` route can forget authentication; services scope every
//! query by `Principal::visible_teams`. OIDC sign-in slots in as another way to build a
//! `Principal`.

mod principal;
pub mod tokens;

pub use principal::{Membership, Principal, Role};
