//! Who is calling and what they may touch. API tokens (`agt_pat_…`, random, stored as a
//! SHA-256 hash, revocable, scoped, expiring) resolve to a `Principal`: a user with their
//! team memberships, or a team service token acting with one role. The policy — which
//! role and which token scope each operation needs — lives in `policy`; the API checks
//! the scope of every route before its handler runs, and services check the role in the
//! team of the resource they touch. Nothing here knows HTTP: failures are `AuthError`s,
//! which the API maps to problem+json. OIDC sign-in slots in as another way to build a
//! `Principal`.

mod error;
pub mod policy;
mod principal;
pub mod tokens;

pub use error::AuthError;
pub use policy::Operation;
pub use principal::{Access, ActorKind, Membership, Principal, Role, Scope, authenticate};
