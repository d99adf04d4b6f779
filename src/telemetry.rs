//! Logging and tracing: human-readable text by default, JSON lines in production
//! (`log.format = "json"`); `RUST_LOG` overrides `log.filter`. When `log.otlp_endpoint` is
//! set, spans are also exported over OTLP/HTTP (protobuf) to that collector; otherwise no
//! exporter runs. Secrets never reach a log: settings redact them in `Debug`, and tokens
//! are only ever logged by id.
//!
//! The exporter takes agentry's `info` spans and events (and other crates' warnings)
//! whatever the log filter says, so a quiet log does not empty the traces; the spans are
//! listed in docs/operations.md.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::LogSettings;

/// Flushes exported spans when dropped; keep it alive for the life of the process.
pub struct TelemetryGuard(Option<SdkTracerProvider>);

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take()
            && let Err(e) = p.shutdown()
        {
            eprintln!("agentry: could not flush traces: {e}");
        }
    }
}

/// Install the global subscriber (later calls do nothing).
pub fn init(settings: &LogSettings) -> TelemetryGuard {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&settings.filter));
    let fmt = if settings.format == "json" {
        tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed()
    };
    let (otel, provider) = match settings.otlp_endpoint.as_deref().map(otlp_provider) {
        Some(Ok(provider)) => {
            let tracer = provider.tracer("agentry");
            (
                Some(
                    tracing_opentelemetry::layer()
                        .with_tracer(tracer)
                        .with_filter(
                            Targets::new()
                                .with_target("agentry", tracing::Level::INFO)
                                .with_default(tracing::Level::WARN),
                        )
                        .boxed(),
                ),
                Some(provider),
            )
        }
        Some(Err(e)) => {
            eprintln!("agentry: OTLP export disabled: {e}");
            (None, None)
        }
        None => (None, None),
    };
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .try_init();
    TelemetryGuard(provider)
}

/// The OpenTelemetry trace id of `span` (32 lowercase hex digits) when the span is
/// exported; `None` when no exporter runs, or the span is disabled or not sampled (an id
/// a collector never receives would lead nowhere).
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    use opentelemetry::trace::TraceContextExt as _;
    let cx = span.context();
    let span_context = cx.span().span_context().clone();
    (span_context.is_valid() && span_context.is_sampled())
        .then(|| span_context.trace_id().to_string())
}

fn otlp_provider(endpoint: &str) -> anyhow::Result<SdkTracerProvider> {
    let url = format!("{}/v1/traces", endpoint.trim_end_matches('/'));
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(url)
        .with_http_client(reqwest_blocking()?)
        .build()?;
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name("agentry").build())
        .build())
}

/// Make ring the process's TLS crypto provider. Every HTTP client (reqwest over rustls)
/// needs one; the server, its client commands and the tests call this before building
/// any. Calling it again does nothing.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn reqwest_blocking() -> anyhow::Result<reqwest::blocking::Client> {
    install_crypto_provider();
    // Built on its own thread: the blocking client must not be created inside a runtime.
    std::thread::spawn(|| reqwest::blocking::Client::builder().build())
        .join()
        .map_err(|_| anyhow::anyhow!("the HTTP client for OTLP could not be built"))?
        .map_err(Into::into)
}
