//! OpenTelemetry trace export over OTLP/HTTP with the JSON encoding (cargo feature `otlp`,
//! on by default; switched on at run time by `[tracing] otlp_endpoint`).
//!
//! A `tracing` layer turns the gateway's own spans (targets under `sluice`) into OTLP spans:
//! `request` (one per ingress request, kind SERVER), `deliver` (one per batch a
//! subscription delivers, kind PRODUCER) and any span inside them, with their fields as
//! attributes (an `otel.kind` field sets another kind); a warning or error logged inside
//! a span sets its status to ERROR with that message. The trace
//! crosses the gateway: a request's span continues the caller's W3C `traceparent`, and a
//! delivery's span continues the delivered event's `traceparent` extension (one event) or
//! links to each event's trace (a batch; up to 32 links). Spans go through a bounded queue
//! (what does not fit is counted and dropped, never waited for) to one exporter task that
//! posts batches to `{otlp_endpoint}/v1/traces` every second or every 256 spans.
//!
//! The encoding follows the OTLP specification's JSON mapping (protocol buffers JSON with
//! lowerCamelCase names, trace and span ids as hex strings, 64-bit times as strings, enums
//! as integers), which collectors accept on their OTLP/HTTP receiver (port 4318).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, watch};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use crate::event::http::parse_traceparent;

/// Spans waiting for the exporter; more are dropped (and counted).
const QUEUE: usize = 8192;
/// Spans per export request.
const BATCH: usize = 256;
/// Links a delivery span keeps (one per event of its batch that carries a trace).
pub const MAX_LINKS: usize = 32;

static ENABLED: AtomicBool = AtomicBool::new(false);
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Whether spans are exported: callers skip work (reading trace contexts) when not.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Spans dropped because the exporter's queue was full.
pub fn dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

type TraceId = [u8; 16];
type SpanId = [u8; 8];

/// A `traceparent`'s ids and its `sampled` flag, read by the gateway's one parser
/// (`event::http::parse_traceparent`: the W3C rules, lower-case hex only), so a trace
/// context that ingress would not pass on is not continued here either.
fn parse_context(value: &str) -> Option<(TraceId, SpanId, bool)> {
    parse_traceparent(value.trim()).map(|t| (t.trace_id, t.parent_id, t.sampled()))
}

fn hex_into(out: &mut Vec<u8>, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)]);
        out.push(DIGITS[usize::from(b & 15)]);
    }
}

#[cfg(test)]
fn hex(bytes: &[u8]) -> String {
    let mut out = Vec::new();
    hex_into(&mut out, bytes);
    String::from_utf8(out).unwrap_or_default()
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// One finished span, as exported.
#[derive(Debug, Clone)]
struct SpanData {
    trace_id: TraceId,
    span_id: SpanId,
    parent: Option<SpanId>,
    name: &'static str,
    kind: u8,
    start_ns: u64,
    end_ns: u64,
    attributes: Vec<(&'static str, Attr)>,
    links: Vec<(TraceId, SpanId)>,
    error: Option<String>,
    /// Exported (the trace's sampling decision, taken at its root or by its caller).
    sampled: bool,
}

/// An attribute's value (OTLP `AnyValue`).
#[derive(Debug, Clone, PartialEq)]
enum Attr {
    Str(String),
    Int(i64),
    Bool(bool),
    Double(f64),
}

/// What the layer keeps with each open span.
struct SpanState(SpanData);

/// The fields of a span or event: attributes, plus the ones the layer reads itself.
#[derive(Default)]
struct Fields {
    attributes: Vec<(&'static str, Attr)>,
    traceparent: Option<String>,
    links: Option<String>,
    kind: Option<u8>,
    message: Option<String>,
}

impl Fields {
    fn put(&mut self, name: &'static str, value: String) {
        match name {
            "traceparent" => self.traceparent = Some(value),
            "trace_links" => self.links = Some(value),
            "otel.kind" => self.kind = Some(kind_of(&value)),
            "message" => self.message = Some(value),
            name => self.attributes.push((name, Attr::Str(value))),
        }
    }
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field.name(), value.to_string());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.put(field.name(), format!("{value:?}"));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        let value = i64::try_from(value).unwrap_or(i64::MAX);
        self.attributes.push((field.name(), Attr::Int(value)));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.attributes.push((field.name(), Attr::Int(value)));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.attributes.push((field.name(), Attr::Bool(value)));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.attributes.push((field.name(), Attr::Double(value)));
    }
}

/// OTLP `SpanKind`: INTERNAL 1, SERVER 2, CLIENT 3, PRODUCER 4, CONSUMER 5.
fn kind_of(name: &str) -> u8 {
    match name {
        "server" => 2,
        "client" => 3,
        "producer" => 4,
        "consumer" => 5,
        _ => 1,
    }
}

/// The layer: see the module documentation.
pub struct OtlpLayer {
    queue: mpsc::Sender<SpanData>,
    /// Share of new traces exported (a caller's own decision, its `sampled` flag, wins).
    sample_ratio: f64,
}

impl<S> Layer<S> for OtlpLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else {
            return;
        };
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        let local_parent = span.parent().and_then(|p| {
            p.extensions()
                .get::<SpanState>()
                .map(|s| (s.0.trace_id, s.0.span_id, s.0.sampled))
        });
        let remote = fields.traceparent.as_deref().and_then(parse_context);
        let (trace_id, parent, sampled) = match (local_parent, remote) {
            (Some((trace, span, sampled)), _) | (None, Some((trace, span, sampled))) => {
                (trace, Some(span), sampled)
            }
            (None, None) => (
                fastrand::u128(..).to_be_bytes(),
                None,
                self.sample_ratio >= 1.0 || fastrand::f64() < self.sample_ratio,
            ),
        };
        let links = fields.links.as_deref().map(parse_links).unwrap_or_default();
        let data = SpanData {
            trace_id,
            span_id: fastrand::u64(1..).to_be_bytes(),
            parent,
            name: attrs.metadata().name(),
            kind: fields.kind.unwrap_or(match attrs.metadata().name() {
                "request" => 2,
                "deliver" => 4,
                _ => 1,
            }),
            start_ns: now_ns(),
            end_ns: 0,
            attributes: fields.attributes,
            links,
            error: None,
            sampled,
        };
        span.extensions_mut().insert(SpanState(data));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else {
            return;
        };
        let mut fields = Fields::default();
        values.record(&mut fields);
        let mut extensions = span.extensions_mut();
        let Some(SpanState(data)) = extensions.get_mut::<SpanState>() else {
            return;
        };
        // A trace context recorded after the span began (read from the request or the
        // batch once known) applies while the span has no parent of its own.
        if data.parent.is_none() {
            if let Some((trace, parent, sampled)) =
                fields.traceparent.as_deref().and_then(parse_context)
            {
                data.trace_id = trace;
                data.parent = Some(parent);
                data.sampled = sampled;
            }
        }
        if let Some(links) = fields.links.as_deref() {
            data.links = parse_links(links);
        }
        data.attributes.extend(fields.attributes);
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        if *event.metadata().level() > Level::WARN {
            return;
        }
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        let mut fields = Fields::default();
        event.record(&mut fields);
        let mut extensions = span.extensions_mut();
        if let Some(SpanState(data)) = extensions.get_mut::<SpanState>() {
            if data.error.is_none() {
                data.error = Some(fields.message.unwrap_or_else(|| "failed".to_string()));
            }
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else {
            return;
        };
        let Some(SpanState(mut data)) = span.extensions_mut().remove::<SpanState>() else {
            return;
        };
        if !data.sampled {
            return;
        }
        data.end_ns = now_ns();
        if self.queue.try_send(data).is_err() {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn parse_links(text: &str) -> Vec<(TraceId, SpanId)> {
    text.split([' ', ','])
        .filter_map(parse_traceparent)
        .map(|t| (t.trace_id, t.parent_id))
        .take(MAX_LINKS)
        .collect()
}

/// Where spans go and what the resource says about this process.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The collector's OTLP/HTTP base address; spans go to `{endpoint}/v1/traces`.
    pub endpoint: String,
    pub service_name: String,
    /// Extra request headers (an API key of a hosted collector), resolved.
    pub headers: BTreeMap<String, String>,
    /// Share of new traces exported, 0 to 1.
    pub sample_ratio: f64,
}

/// The exporter half: runs on the runtime once it exists.
pub struct Exporter {
    queue: mpsc::Receiver<SpanData>,
    settings: Settings,
}

/// The layer and its exporter. Export starts once `Exporter::run` is spawned.
pub fn pipeline(settings: Settings) -> (OtlpLayer, Exporter) {
    let (tx, rx) = mpsc::channel(QUEUE);
    ENABLED.store(true, Ordering::Relaxed);
    (
        OtlpLayer {
            queue: tx,
            sample_ratio: settings.sample_ratio,
        },
        Exporter {
            queue: rx,
            settings,
        },
    )
}

impl Exporter {
    /// Posts batches until `stop`, then sends what is queued (bounded by a few seconds).
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let client = match reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
        {
            Ok(client) => client,
            Err(e) => {
                tracing::error!(error = %e, "cannot make the OTLP client; spans are not exported");
                ENABLED.store(false, Ordering::Relaxed);
                return;
            }
        };
        let url = format!("{}/v1/traces", self.settings.endpoint.trim_end_matches('/'));
        let mut batch = Vec::with_capacity(BATCH);
        let mut failures = 0u32;
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let stopping = tokio::select! {
                span = self.queue.recv() => match span {
                    Some(span) => {
                        batch.push(span);
                        if batch.len() < BATCH {
                            continue;
                        }
                        false
                    }
                    None => true,
                },
                _ = tick.tick() => false,
                _ = stop.wait_for(|s| *s) => true,
            };
            if stopping {
                while let Ok(span) = self.queue.try_recv() {
                    batch.push(span);
                }
            }
            for chunk in batch.chunks(BATCH) {
                let mut body = Vec::with_capacity(chunk.len() * 512);
                encode(chunk, &self.settings.service_name, &mut body);
                let mut request = client
                    .post(&url)
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(body);
                for (k, v) in &self.settings.headers {
                    request = request.header(k, v);
                }
                let outcome = match request.send().await {
                    Ok(r) if r.status().is_success() => Ok(()),
                    Ok(r) => Err(format!("the collector answered {}", r.status())),
                    Err(e) => Err(e.to_string()),
                };
                match outcome {
                    Ok(()) => failures = 0,
                    Err(e) => {
                        failures += 1;
                        // Said once, then every 60th failure: a collector that is down must
                        // not flood the log.
                        if failures % 60 == 1 {
                            tracing::warn!(url = %crate::values::redact_url(&url), error = %e, spans = chunk.len(), "OTLP export failed; these spans are dropped");
                        }
                    }
                }
            }
            batch.clear();
            if stopping {
                return;
            }
        }
    }
}

/// The OTLP `ExportTraceServiceRequest` of `spans`, in the JSON mapping, written straight
/// into `out` (no intermediate JSON tree: the exporter runs at the request rate).
fn encode(spans: &[SpanData], service_name: &str, out: &mut Vec<u8>) {
    use std::io::Write;
    let string = |out: &mut Vec<u8>, s: &str| {
        // Escapes as JSON requires; writing into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, s);
    };
    out.extend_from_slice(br#"{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name","value":{"stringValue":"#);
    string(out, service_name);
    out.extend_from_slice(br#"}},{"key":"service.version","value":{"stringValue":"#);
    string(out, env!("CARGO_PKG_VERSION"));
    out.extend_from_slice(br#"}}]},"scopeSpans":[{"scope":{"name":"sluice","version":"#);
    string(out, env!("CARGO_PKG_VERSION"));
    out.extend_from_slice(br#"},"spans":["#);
    for (i, s) in spans.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(br#"{"traceId":""#);
        hex_into(out, &s.trace_id);
        out.extend_from_slice(br#"","spanId":""#);
        hex_into(out, &s.span_id);
        out.extend_from_slice(br#"","#);
        if let Some(parent) = &s.parent {
            out.extend_from_slice(br#""parentSpanId":""#);
            hex_into(out, parent);
            out.extend_from_slice(br#"","#);
        }
        out.extend_from_slice(br#""name":"#);
        string(out, s.name);
        let _ = write!(
            out,
            r#","kind":{},"startTimeUnixNano":"{}","endTimeUnixNano":"{}","attributes":["#,
            s.kind, s.start_ns, s.end_ns
        );
        for (j, (key, value)) in s.attributes.iter().enumerate() {
            if j > 0 {
                out.push(b',');
            }
            out.extend_from_slice(br#"{"key":"#);
            string(out, key);
            out.extend_from_slice(br#","value":{"#);
            match value {
                Attr::Str(v) => {
                    out.extend_from_slice(br#""stringValue":"#);
                    string(out, v);
                }
                // int64 is a string in the JSON mapping.
                Attr::Int(v) => {
                    let _ = write!(out, r#""intValue":"{v}""#);
                }
                Attr::Bool(v) => {
                    let _ = write!(out, r#""boolValue":{v}"#);
                }
                Attr::Double(v) if v.is_finite() => {
                    let _ = write!(out, r#""doubleValue":{v}"#);
                }
                // NaN and infinities are strings in the protobuf JSON mapping.
                Attr::Double(v) => {
                    let _ = write!(
                        out,
                        r#""doubleValue":"{}""#,
                        if v.is_nan() {
                            "NaN"
                        } else if *v > 0.0 {
                            "Infinity"
                        } else {
                            "-Infinity"
                        }
                    );
                }
            }
            out.extend_from_slice(b"}}");
        }
        out.push(b']');
        if !s.links.is_empty() {
            out.extend_from_slice(br#","links":["#);
            for (j, (trace, span)) in s.links.iter().enumerate() {
                if j > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(br#"{"traceId":""#);
                hex_into(out, trace);
                out.extend_from_slice(br#"","spanId":""#);
                hex_into(out, span);
                out.extend_from_slice(br#""}"#);
            }
            out.push(b']');
        }
        // Status codes: UNSET 0, OK 1, ERROR 2.
        if let Some(message) = &s.error {
            out.extend_from_slice(br#","status":{"code":2,"message":"#);
            string(out, message);
            out.push(b'}');
        }
        out.push(b'}');
    }
    out.extend_from_slice(b"]}]}]}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn traceparents_are_read_as_the_w3c_format_says() {
        let (t, s, sampled) =
            parse_context(" 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01 ").unwrap();
        assert_eq!(hex(&t), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(hex(&s), "b7ad6b7169203331");
        assert!(sampled);
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0af7651916cd43dd8448eb211c80319-cb7ad6b7169203331-01",
            "00-zzf7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            assert!(parse_context(bad).is_none(), "{bad}");
        }
    }

    /// What ingress passes on (`valid_traceparent`) and what export continues are the same
    /// set: upper-case hex, which the W3C specification tells receivers to ignore, is neither.
    #[test]
    fn export_and_ingress_agree_on_traceparents() {
        for value in [
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-later",
            "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01x",
            "zz-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            assert_eq!(
                parse_context(value).is_some(),
                crate::event::http::valid_traceparent(value),
                "{value}"
            );
        }
        assert!(parse_context("00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01").is_none());
        let links = parse_links(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01,\
             00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01 \
             00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-01",
        );
        assert_eq!(links.len(), 2, "the upper-case one is not a link");
    }

    #[tokio::test]
    async fn spans_continue_the_callers_trace_and_are_encoded_as_otlp_json() {
        let (layer, mut exporter) = pipeline(Settings {
            endpoint: "http://127.0.0.1:9".into(),
            service_name: "test".into(),
            headers: BTreeMap::new(),
            sample_ratio: 1.0,
        });
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            let request = tracing::info_span!(
                "request",
                bus = "orders",
                traceparent = tracing::field::Empty
            );
            request.record(
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            );
            request.in_scope(|| {
                let inner = tracing::info_span!("append", events = 3u64);
                inner.in_scope(|| tracing::error!("disk full"));
            });
            drop(request);
            let unsampled = tracing::info_span!("request", traceparent = tracing::field::Empty);
            unsampled.record(
                "traceparent",
                "00-99999999999999999999999999999999-b7ad6b7169203331-00",
            );
            unsampled.in_scope(|| drop(tracing::info_span!("append")));
            drop(unsampled);
            let deliver = tracing::info_span!(
                "deliver",
                trace_links = "00-11111111111111111111111111111111-2222222222222222-01 00-33333333333333333333333333333333-4444444444444444-01",
            );
            drop(deliver);
        });
        let mut spans = Vec::new();
        while let Ok(s) = exporter.queue.try_recv() {
            spans.push(s);
        }
        let mut bytes = Vec::new();
        encode(&spans, "test", &mut bytes);
        let body: Value = serde_json::from_slice(&bytes).unwrap();
        let spans = body["resourceSpans"][0]["scopeSpans"][0]["spans"]
            .as_array()
            .unwrap()
            .clone();
        let by_name = |n: &str| spans.iter().find(|s| s["name"] == n).unwrap().clone();
        let request = by_name("request");
        assert_eq!(request["traceId"], "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(request["parentSpanId"], "b7ad6b7169203331");
        assert_eq!(request["kind"], 2);
        assert!(request["attributes"]
            .as_array()
            .unwrap()
            .contains(&json!({"key": "bus", "value": {"stringValue": "orders"}})));
        let append = by_name("append");
        assert_eq!(append["traceId"], request["traceId"]);
        assert_eq!(append["parentSpanId"], request["spanId"]);
        assert_eq!(append["status"]["code"], 2);
        assert_eq!(append["status"]["message"], "disk full");
        assert_eq!(
            append["attributes"][0],
            json!({"key": "events", "value": {"intValue": "3"}})
        );
        assert!(
            !spans
                .iter()
                .any(|s| s["traceId"] == "99999999999999999999999999999999"),
            "a caller that did not sample its trace is not exported"
        );
        let deliver = by_name("deliver");
        assert_eq!(deliver["kind"], 4);
        assert!(deliver.get("parentSpanId").is_none());
        assert_eq!(deliver["links"].as_array().unwrap().len(), 2);
        assert_eq!(deliver["links"][1]["spanId"], "4444444444444444");
        let start: u64 = request["startTimeUnixNano"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        let end: u64 = request["endTimeUnixNano"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(start > 0 && end >= start);
        assert_eq!(
            body["resourceSpans"][0]["resource"]["attributes"][0]["value"]["stringValue"],
            "test"
        );
    }
}
