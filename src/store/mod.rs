//! SQL, grouped by aggregate; every function takes an executor or a transaction.

pub mod embedded;
pub mod processes;
