//! The ACP adapter.
