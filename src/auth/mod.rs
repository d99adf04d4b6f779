//! Who is calling and what they may touch. API tokens (`agt_pat_…`, random, stored as a
//! SHA-256 hash, revocable, scoped, expiring) resolve to a `Principal`: a user with their
//! team memberships, or a team service token acting with one role. The policy — team
//! roles and token scopes — lives on `Principal`, and services apply it to every
//! operation. Nothing here knows HTTP: failures are `AuthError`s, which the API maps to
//! problem+json. OIDC sign-in slots in as another way to build a `Principal`.

mod error;
mod principal;
pub mod tokens;

pub use error::AuthError;
pub use principal::{Access, Membership, Principal, Role, Scope, authenticate};
