//! services
