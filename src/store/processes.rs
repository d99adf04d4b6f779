//! Queries on the `managed_processes` ledger.
