//! auth
