//! Instruments for `GET /metrics` (Prometheus text format 0.0.4): counters and
//! histograms, alone or in families keyed by label values, cheap to update from any
//! layer (atomics; a family takes a short lock to find its member). Each component owns
//! its instruments; the HTTP edge gathers them into one page at scrape time.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }

    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Observations counted into fixed buckets (upper bounds, ascending), with their sum.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// One per bound, then the `+Inf` bucket; not cumulative (summed when rendered).
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    /// The sum, as f64 bits.
    sum: AtomicU64,
}

/// Seconds, from 100 µs to 10 s: request and commit latencies.
pub const SECONDS: &[f64] = &[
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Counts, from 1 to 4096 in powers of two: batch sizes.
pub const SIZES: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
];

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }

    pub fn observe(&self, value: f64) {
        let i = self
            .bounds
            .iter()
            .position(|b| value <= *b)
            .unwrap_or(self.bounds.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        let _ = self
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + value).to_bits())
            });
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    pub fn sum(&self) -> f64 {
        f64::from_bits(self.sum.load(Ordering::Relaxed))
    }
}

/// Instruments of one metric told apart by their label values (in the order of the
/// family's label names).
#[derive(Debug)]
pub struct Family<M> {
    labels: &'static [&'static str],
    members: Mutex<BTreeMap<Vec<String>, Arc<M>>>,
    make: fn() -> M,
}

impl<M> Family<M> {
    pub fn new(labels: &'static [&'static str], make: fn() -> M) -> Self {
        Self {
            labels,
            members: Mutex::new(BTreeMap::new()),
            make,
        }
    }

    /// The member for `values` (one per label name), created on first use.
    pub fn with(&self, values: &[&str]) -> Arc<M> {
        debug_assert_eq!(values.len(), self.labels.len());
        let key: Vec<String> = values.iter().map(|v| (*v).to_owned()).collect();
        let mut members = self.members.lock().unwrap_or_else(|p| p.into_inner());
        members
            .entry(key)
            .or_insert_with(|| Arc::new((self.make)()))
            .clone()
    }

    fn snapshot(&self) -> Vec<(Vec<String>, Arc<M>)> {
        let members = self.members.lock().unwrap_or_else(|p| p.into_inner());
        members
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}

impl Family<Counter> {
    pub fn counters(labels: &'static [&'static str]) -> Self {
        Self::new(labels, Counter::default)
    }
}

/// One page of metrics being written.
#[derive(Default)]
pub struct Page {
    text: String,
}

/// `{a="x",b="y"}` with values escaped, or nothing for no labels.
fn label_set(names: &[&str], values: &[String], extra: Option<(&str, &str)>) -> String {
    let mut pairs: Vec<String> = names
        .iter()
        .zip(values)
        .map(|(n, v)| format!("{n}=\"{}\"", escape(v)))
        .collect();
    if let Some((n, v)) = extra {
        pairs.push(format!("{n}=\"{}\"", escape(v)));
    }
    if pairs.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", pairs.join(","))
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', r"\\")
        .replace('"', "\\\"")
        .replace('\n', r"\n")
}

/// A sample value or bucket bound as the exposition format spells it: `+Inf`, `-Inf`,
/// `NaN`, or the number.
fn number(v: f64) -> String {
    if v == f64::INFINITY {
        "+Inf".to_owned()
    } else if v == f64::NEG_INFINITY {
        "-Inf".to_owned()
    } else {
        format!("{v}")
    }
}

impl Page {
    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
    }

    pub fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.header(name, "counter", help);
        let _ = writeln!(self.text, "{name} {value}");
    }

    pub fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.header(name, "gauge", help);
        let _ = writeln!(self.text, "{name} {}", number(value));
    }

    /// A gauge with one sample per label set.
    pub fn gauges(
        &mut self,
        name: &str,
        help: &str,
        labels: &[&str],
        samples: &[(Vec<String>, f64)],
    ) {
        self.header(name, "gauge", help);
        for (values, v) in samples {
            let _ = writeln!(
                self.text,
                "{name}{} {}",
                label_set(labels, values, None),
                number(*v)
            );
        }
    }

    pub fn counter_family(&mut self, name: &str, help: &str, family: &Family<Counter>) {
        self.header(name, "counter", help);
        for (values, c) in family.snapshot() {
            let _ = writeln!(
                self.text,
                "{name}{} {}",
                label_set(family.labels, &values, None),
                c.get()
            );
        }
    }

    /// A counter family kept in integer units of `1 / per` (cost in millionths of a USD),
    /// shown in whole units.
    pub fn counter_family_scaled(
        &mut self,
        name: &str,
        help: &str,
        family: &Family<Counter>,
        per: f64,
    ) {
        self.header(name, "counter", help);
        for (values, c) in family.snapshot() {
            let _ = writeln!(
                self.text,
                "{name}{} {}",
                label_set(family.labels, &values, None),
                number(c.get() as f64 / per)
            );
        }
    }

    pub fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.header(name, "histogram", help);
        self.histogram_samples(name, &[], &[], h);
    }

    pub fn histogram_family(&mut self, name: &str, help: &str, family: &Family<Histogram>) {
        self.header(name, "histogram", help);
        for (values, h) in family.snapshot() {
            self.histogram_samples(name, family.labels, &values, &h);
        }
    }

    fn histogram_samples(&mut self, name: &str, labels: &[&str], values: &[String], h: &Histogram) {
        let mut cumulative = 0;
        let bounds = h.bounds.iter().copied().chain([f64::INFINITY]);
        for (bound, bucket) in bounds.zip(&h.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            let le = number(bound);
            let _ = writeln!(
                self.text,
                "{name}_bucket{} {cumulative}",
                label_set(labels, values, Some(("le", &le)))
            );
        }
        let set = label_set(labels, values, None);
        let _ = writeln!(self.text, "{name}_sum{set} {}", number(h.sum()));
        // The count is the +Inf bucket, so the page is consistent even while observed.
        let _ = writeln!(self.text, "{name}_count{set} {cumulative}");
    }

    pub fn finish(self) -> String {
        self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_render_cumulative_buckets() {
        let h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(0.5);
        h.observe(7.0);
        let mut page = Page::default();
        page.histogram("x_seconds", "x", &h);
        let text = page.finish();
        assert!(text.contains("# TYPE x_seconds histogram\n"));
        assert!(text.contains("x_seconds_bucket{le=\"0.1\"} 1\n"), "{text}");
        assert!(text.contains("x_seconds_bucket{le=\"1\"} 3\n"), "{text}");
        assert!(text.contains("x_seconds_bucket{le=\"+Inf\"} 4\n"), "{text}");
        assert!(text.contains("x_seconds_sum 8.05\n"), "{text}");
        assert!(text.contains("x_seconds_count 4\n"), "{text}");
    }

    #[test]
    fn infinities_keep_their_sign() {
        // A bound of -Inf counts only observations of -Inf; its bucket and the sum it
        // drags down must not read as +Inf.
        static BOUNDS: &[f64] = &[f64::NEG_INFINITY, 0.0];
        let h = Histogram::new(BOUNDS);
        h.observe(f64::NEG_INFINITY);
        h.observe(-1.0);
        let mut page = Page::default();
        page.histogram("x", "x", &h);
        page.gauge("y", "y", f64::NEG_INFINITY);
        page.gauge("z", "z", f64::NAN);
        let text = page.finish();
        assert!(text.contains("x_bucket{le=\"-Inf\"} 1\n"), "{text}");
        assert!(text.contains("x_bucket{le=\"0\"} 2\n"), "{text}");
        assert!(text.contains("x_bucket{le=\"+Inf\"} 2\n"), "{text}");
        assert!(text.contains("x_sum -Inf\n"), "{text}");
        assert!(text.contains("y -Inf\n"), "{text}");
        assert!(text.contains("z NaN\n"), "{text}");
        assert_eq!(number(f64::INFINITY), "+Inf");
        assert_eq!(number(-0.5), "-0.5");
    }

    #[test]
    fn families_keep_one_member_per_label_set_and_escape_values() {
        let f = Family::counters(&["route", "status"]);
        f.with(&["/v1/a", "200"]).inc();
        f.with(&["/v1/a", "200"]).inc();
        f.with(&["/v1/\"b\"", "404"]).inc();
        let mut page = Page::default();
        page.counter_family("req_total", "requests", &f);
        let text = page.finish();
        assert!(
            text.contains("req_total{route=\"/v1/a\",status=\"200\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("req_total{route=\"/v1/\\\"b\\\"\",status=\"404\"} 1\n"),
            "{text}"
        );
    }
}
