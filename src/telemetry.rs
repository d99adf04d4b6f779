//! Logging and tracing: human-readable text by default, JSON lines in production
//! (`log.format = "json"`). `RUST_LOG` overrides `log.filter`. Secrets never reach a log:
//! settings redact them in `Debug`, and tokens are only ever logged by id.

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::FmtSpan;

use crate::config::LogSettings;

/// Install the global subscriber. Safe to call more than once (later calls do nothing).
pub fn init(settings: &LogSettings) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&settings.filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if settings.format == "json" {
        builder
            .json()
            .with_current_span(true)
            .with_span_events(FmtSpan::NONE)
            .try_init()
    } else {
        builder.try_init()
    };
    if let Some(endpoint) = &settings.otlp_endpoint {
        tracing::warn!(
            %endpoint,
            "log.otlp_endpoint is set, but this build exports no OTLP traces; logs go to stderr"
        );
    }
}
