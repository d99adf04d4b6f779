//! Why a write failed, as the writer needs to know it: the store could not be reached (keep
//! the batch and retry), the database refused what was written (store the batch row by
//! row and set the refused events aside), or a sequence slot was already taken (number again).

/// The three ways a write can fail, for the writer's purposes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Unreachable, stalled, restarting, out of resources, or a transient conflict:
    /// the same write can succeed later. Never a reason to drop anything.
    Unavailable,
    /// The database refused the data itself (data exceptions, program limits, integrity
    /// and trigger refusals): the same write will fail again.
    Content,
    /// `(agent_id, seq)` already exists: someone else wrote that slot.
    SeqTaken,
}

/// Classify an error from a write of events.
pub fn classify(err: &sqlx::Error) -> Fault {
    match err {
        sqlx::Error::Database(db) => {
            let code = db.code();
            let code = code.as_deref().unwrap_or("");
            if code == "23505" && db.constraint() == Some("agent_events_pkey") {
                return Fault::SeqTaken;
            }
            classify_sqlstate(code)
        }
        // The data could not be encoded for the wire.
        sqlx::Error::Encode(_) => Fault::Content,
        // Connections, pools, TLS, protocol breaks and everything unexpected: retry. An
        // unknown failure must not be answered by dropping events.
        _ => Fault::Unavailable,
    }
}

/// Classify a SQLSTATE (five characters).
pub fn classify_sqlstate(code: &str) -> Fault {
    let class = code.get(..2).unwrap_or("");
    match class {
        // 22 data exception (e.g. 22P05 untranslatable character), 23 integrity
        // constraint violation, 54 program limit exceeded (e.g. a value too large),
        // P0 raised by a trigger or function, 2F/38/39 SQL routine refusals.
        "22" | "23" | "54" | "P0" | "2F" | "38" | "39" => Fault::Content,
        // 08 connection exception, 53 insufficient resources, 57 operator intervention
        // (57P01..57P03 shutdown, cannot connect now; 57014 canceled), 58 system error,
        // 40 serialization failure or deadlock, 55 lock not available, XX internal.
        _ => Fault::Unavailable,
    }
}

/// Whether `err` means the store cannot be reached or is stalled (for mapping to 503).
pub fn is_unavailable(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::BeginFailed => true,
        sqlx::Error::Database(db) => {
            let code = db.code();
            let code = code.as_deref().unwrap_or("");
            code.starts_with("08")
                || code.starts_with("53")
                || matches!(code, "57P01" | "57P02" | "57P03")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_refusals_are_content() {
        for code in [
            "22P05", "22021", "22001", "23514", "23502", "54000", "P0001",
        ] {
            assert_eq!(classify_sqlstate(code), Fault::Content, "{code}");
        }
    }

    #[test]
    fn outages_are_unavailable() {
        for code in [
            "08006", "08001", "08003", "57P01", "57P02", "57P03", "53300", "53100", "40001",
            "40P01", "55P03", "58030", "XX000",
        ] {
            assert_eq!(classify_sqlstate(code), Fault::Unavailable, "{code}");
        }
    }

    #[test]
    fn errors_without_a_sqlstate() {
        assert_eq!(classify(&sqlx::Error::PoolTimedOut), Fault::Unavailable);
        assert_eq!(
            classify(&sqlx::Error::Io(std::io::Error::from(
                std::io::ErrorKind::ConnectionReset
            ))),
            Fault::Unavailable
        );
        assert_eq!(classify(&sqlx::Error::Encode("bad".into())), Fault::Content);
        assert!(is_unavailable(&sqlx::Error::PoolTimedOut));
        assert!(!is_unavailable(&sqlx::Error::RowNotFound));
    }
}
