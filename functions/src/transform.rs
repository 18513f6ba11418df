//! Transform chains, in the style of the EventBridge / RocketMQ EventBridge input
//! transformer. A chain is a list of steps applied in order to an event:
//!
//! - event steps (`ORIGINAL`, `SET_ATTRIBUTES`, `REMOVE_ATTRIBUTES`, `RENAME_ATTRIBUTES`,
//!   `MAP_DATA`) turn the event into a new event;
//! - body steps (`CONSTANT`, `JSONPATH`, `TEMPLATE`) render a raw body for the target and
//!   must come last, unless they carry `"into": "data"`, in which case their result becomes
//!   the event's data and the chain goes on.
//!
//! - a function step (`{"wasm": "name"}`) hands the event to a user function the caller
//!   runs ([`FunctionHost`]); it may return no event (the event is dropped), one, or several
//!   (the steps after it run on each, in order).
//!
//! JSONPath expressions and templates read the event in CloudEvents structured JSON form
//! (attributes plus `data`, with a JSON payload parsed). Everything is compiled up front;
//! applying a chain never panics and reports a failure as that event's error.

use cloudevents::{AttributesReader, AttributesWriter, Data, Event};
use jsonpath_rust::parser::model::{JpQuery, Segment, Selector};
use jsonpath_rust::parser::parse_json_path;
use jsonpath_rust::query::js_path_process;
use serde_json::{Map, Value};

use crate::template::Template;
use crate::view::{data_json, is_attribute_name, with_attribute, Attr, Leaf, NumKey};

/// What a chain produces for one event.
#[derive(Debug, Clone, PartialEq)]
// Unboxed on purpose: the common case is the event, and callers match on it directly.
#[allow(clippy::large_enum_variant)]
pub enum Output {
    /// A new CloudEvent.
    Event(Event),
    /// A raw body for the target.
    Body {
        content_type: String,
        bytes: Vec<u8>,
    },
}

/// A chain that could not be compiled, or that failed on one event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransformError {
    #[error("invalid transform at step {step}: {message}")]
    Invalid { step: usize, message: String },
    #[error("transform step {step} ({form}) failed on event `{event_id}`: {message}")]
    Apply {
        step: usize,
        form: &'static str,
        event_id: String,
        message: String,
    },
}

/// A compiled transform chain.
#[derive(Debug, Clone)]
pub struct TransformChain {
    steps: Vec<Step>,
}

/// Runs the user functions a chain names (`{"wasm": "name"}` steps): the gateway's
/// WebAssembly runtime, or a test's stand-in. The event goes in; the events it returns,
/// already checked as CloudEvents, come out.
pub trait FunctionHost {
    fn call(&self, name: &str, event: &Event) -> Result<Vec<Event>, String>;

    /// The same call on the event's structured JSON text (the form a function gets): each
    /// returned event, `None` where it is that text unchanged (a filter passing the event
    /// on, say), so the caller can keep the event it has instead of reading it again.
    fn call_text(&self, name: &str, text: &str) -> Result<Vec<Option<Event>>, String>;
}

/// What a chain of user functions alone made of an event given as its structured JSON
/// text ([`TransformChain::apply_text`]).
#[derive(Debug, Clone, PartialEq)]
// As `Output`: consumed at once, never stored in bulk.
#[allow(clippy::large_enum_variant)]
pub enum TextOutput {
    /// The event as it came in: every function returned it unchanged.
    Unchanged,
    /// A new output.
    Changed(Output),
}

#[derive(Debug, Clone)]
struct JsonPath {
    source: String,
    query: JpQuery,
    /// A plain path (`$.a.b`, `$['a']`, `$.a[0]`) resolved by direct navigation, without
    /// building the structured JSON form of the event.
    simple: Option<Vec<Seg>>,
}

#[derive(Debug, Clone, PartialEq)]
enum Seg {
    Key(String),
    Index(usize),
}

/// The segments of a plain path (only child names and non-negative indices), read from
/// the query jsonpath-rust parsed.
fn simple_path(query: &JpQuery) -> Option<Vec<Seg>> {
    let segs = query
        .segments
        .iter()
        .map(|seg| match seg {
            Segment::Selector(Selector::Name(k)) => Some(Seg::Key(k.clone())),
            Segment::Selector(Selector::Index(i)) => usize::try_from(*i).ok().map(Seg::Index),
            _ => None,
        })
        .collect::<Option<Vec<Seg>>>()?;
    // `$` alone and `$.data_base64` need the full structured form.
    match segs.first() {
        Some(Seg::Key(k)) if k != "data_base64" => Some(segs),
        _ => None,
    }
}

/// Resolves a plain path against the event; `None` when it cannot be done directly.
fn select_simple(segs: &[Seg], event: &Event) -> Option<Option<Value>> {
    let (Seg::Key(head), rest) = segs.split_first()? else {
        return None;
    };
    if head == "data" {
        let data = match event.data() {
            None => return Some(None),
            Some(d) => d,
        };
        let Some(root) = data_json(event) else {
            return match (data, rest.is_empty()) {
                (Data::String(s), true) => Some(Some(Value::String(s.clone()))),
                (Data::String(_), false) => Some(None),
                _ => None,
            };
        };
        let mut v: &Value = &root;
        for seg in rest {
            let next = match (seg, v) {
                (Seg::Key(k), Value::Object(m)) => m.get(k),
                (Seg::Index(i), Value::Array(a)) => a.get(*i),
                _ => None,
            };
            match next {
                Some(n) => v = n,
                None => return Some(None),
            }
        }
        return Some(Some(v.clone()));
    }
    if !rest.is_empty() {
        return Some(None);
    }
    let mut out = None;
    with_attribute(event, &Attr::from_name(head), &mut |leaf| {
        out = Some(match leaf {
            Leaf::Str(s) => Value::String(s.to_owned()),
            Leaf::Bool(b) => Value::Bool(b),
            Leaf::Num(n) => match n.key {
                NumKey::Int(i) => i64::try_from(i).map(Value::from).unwrap_or(Value::Null),
                NumKey::Float(_) => {
                    serde_json::Number::from_f64(n.f).map_or(Value::Null, Value::Number)
                }
            },
            Leaf::Null => Value::Null,
        })
    });
    Some(out)
}

/// The event being transformed, with its structured JSON form built only if a path needs it.
struct Doc<'e> {
    event: &'e Event,
    full: Option<Value>,
}

impl<'e> Doc<'e> {
    fn new(event: &'e Event) -> Self {
        Doc { event, full: None }
    }

    fn select(&mut self, path: &JsonPath) -> Result<Option<Value>, String> {
        if let Some(r) = path
            .simple
            .as_deref()
            .and_then(|s| select_simple(s, self.event))
        {
            return Ok(r);
        }
        if self.full.is_none() {
            self.full = Some(structured(self.event)?);
        }
        match &self.full {
            Some(doc) => path.select(doc),
            None => Ok(None),
        }
    }
}

impl JsonPath {
    fn compile(s: &str) -> Result<JsonPath, String> {
        if !s.starts_with('$') {
            return Err(format!("`{s}` is not a JSONPath (it must start with `$`)"));
        }
        let query = parse_json_path(s).map_err(|e| format!("invalid JSONPath `{s}`: {e}"))?;
        Ok(JsonPath {
            source: s.to_owned(),
            simple: simple_path(&query),
            query,
        })
    }

    /// One match gives its value, several an array of them, none `None`.
    fn select(&self, doc: &Value) -> Result<Option<Value>, String> {
        let refs = js_path_process(&self.query, doc)
            .map_err(|e| format!("JSONPath `{}` failed: {e}", self.source))?;
        let mut values: Vec<Value> = refs.into_iter().map(|r| r.val().clone()).collect();
        Ok(match values.len() {
            0 => None,
            1 => values.pop(),
            _ => Some(Value::Array(values)),
        })
    }
}

#[derive(Debug, Clone)]
enum Source {
    Const(Value),
    Path(JsonPath),
}

impl Source {
    fn resolve(&self, doc: &mut Doc<'_>) -> Result<Option<Value>, String> {
        match self {
            Source::Const(v) => Ok(Some(v.clone())),
            Source::Path(p) => doc.select(p),
        }
    }
}

#[derive(Debug, Clone)]
enum Step {
    Original,
    Constant {
        value: Value,
        into_data: bool,
    },
    JsonPath {
        path: JsonPath,
        into_data: bool,
    },
    Template {
        vars: Vec<JsonPath>,
        template: Template,
        into_data: bool,
    },
    SetAttributes(Vec<(String, Source)>),
    RemoveAttributes(Vec<String>),
    RenameAttributes(Vec<(String, String)>),
    /// A user function, by name.
    Function(String),
    MapData {
        fields: Vec<(Vec<String>, Source)>,
        keep: bool,
        remove: Vec<Vec<String>>,
    },
}

impl Step {
    fn form(&self) -> &'static str {
        match self {
            Step::Original => "ORIGINAL",
            Step::Constant { .. } => "CONSTANT",
            Step::JsonPath { .. } => "JSONPATH",
            Step::Template { .. } => "TEMPLATE",
            Step::SetAttributes(_) => "SET_ATTRIBUTES",
            Step::RemoveAttributes(_) => "REMOVE_ATTRIBUTES",
            Step::RenameAttributes(_) => "RENAME_ATTRIBUTES",
            Step::MapData { .. } => "MAP_DATA",
            Step::Function(_) => "WASM",
        }
    }

    fn renders_body(&self) -> bool {
        match self {
            Step::Constant { into_data, .. }
            | Step::JsonPath { into_data, .. }
            | Step::Template { into_data, .. } => !into_data,
            _ => false,
        }
    }
}

const REQUIRED: [&str; 4] = ["id", "source", "type", "specversion"];
const NOT_ATTRIBUTES: [&str; 2] = ["data", "data_base64"];

impl TransformChain {
    /// Compiles a chain: a JSON array of steps, or one step object.
    pub fn compile(spec: &Value) -> Result<TransformChain, TransformError> {
        let items: Vec<&Value> = match spec {
            Value::Array(items) => items.iter().collect(),
            Value::Object(_) => vec![spec],
            _ => {
                return Err(TransformError::Invalid {
                    step: 0,
                    message: "a transform is a step object or an array of steps".into(),
                })
            }
        };
        let mut steps = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let step = compile_step(item)
                .map_err(|message| TransformError::Invalid { step: i, message })?;
            steps.push(step);
        }
        if let Some(pos) = steps.iter().position(Step::renders_body) {
            if pos + 1 != steps.len() {
                return Err(TransformError::Invalid {
                    step: pos,
                    message: format!(
                        "{} renders the body and must be the last step (or add \"into\": \"data\")",
                        steps.get(pos).map_or("step", Step::form)
                    ),
                });
            }
        }
        Ok(TransformChain { steps })
    }

    /// The user functions the chain calls, in order (a name may repeat).
    pub fn functions(&self) -> impl Iterator<Item = &str> {
        self.steps.iter().filter_map(|s| match s {
            Step::Function(name) => Some(name.as_str()),
            _ => None,
        })
    }

    /// Whether the chain calls a user function (and so must be applied with
    /// [`TransformChain::apply_all`]).
    pub fn calls_functions(&self) -> bool {
        self.functions().next().is_some()
    }

    /// Whether every step of the chain calls a user function (and so the chain can run on
    /// an event's structured JSON text: [`TransformChain::apply_text`]).
    pub fn calls_only_functions(&self) -> bool {
        !self.steps.is_empty() && self.steps.iter().all(|s| matches!(s, Step::Function(_)))
    }

    /// Applies the chain to one event, user functions included: every output, in order
    /// (none when a function dropped the event, several when one fanned it out).
    pub fn apply_all(
        &self,
        event: &Event,
        host: &dyn FunctionHost,
    ) -> Result<Vec<Output>, TransformError> {
        let mut out = Vec::new();
        self.apply_from(0, event, event, host, &mut out)?;
        Ok(out)
    }

    /// [`TransformChain::apply_all`] for a chain that calls only functions
    /// ([`TransformChain::calls_only_functions`]), on the event's structured JSON text:
    /// the text goes to the first function as it is, and an event a function returns
    /// unchanged is never read (the common case of a filter); an event a function changed
    /// goes on as an event. `event_id` names the event in an error.
    pub fn apply_text(
        &self,
        text: &str,
        event_id: &dyn Fn() -> String,
        host: &dyn FunctionHost,
    ) -> Result<Vec<TextOutput>, TransformError> {
        let mut out = Vec::new();
        self.apply_text_from(0, text, event_id, host, &mut out)?;
        Ok(out)
    }

    fn apply_text_from(
        &self,
        start: usize,
        text: &str,
        event_id: &dyn Fn() -> String,
        host: &dyn FunctionHost,
        out: &mut Vec<TextOutput>,
    ) -> Result<(), TransformError> {
        let Some(step) = self.steps.get(start) else {
            out.push(TextOutput::Unchanged);
            return Ok(());
        };
        let fail = |message: String| TransformError::Apply {
            step: start,
            form: step.form(),
            event_id: event_id(),
            message,
        };
        let Step::Function(name) = step else {
            return Err(fail(
                "not a function step: the chain must be applied to the event".into(),
            ));
        };
        for returned in host.call_text(name, text).map_err(fail)? {
            match returned {
                None => self.apply_text_from(start + 1, text, event_id, host, out)?,
                Some(next) => {
                    let mut made = Vec::new();
                    self.apply_from(start + 1, &next, &next, host, &mut made)?;
                    out.extend(made.into_iter().map(TextOutput::Changed));
                }
            }
        }
        Ok(())
    }

    fn apply_from(
        &self,
        start: usize,
        input: &Event,
        event: &Event,
        host: &dyn FunctionHost,
        out: &mut Vec<Output>,
    ) -> Result<(), TransformError> {
        let mut current: Option<Event> = None;
        for (i, step) in self.steps.iter().enumerate().skip(start) {
            let fail = |message: String| TransformError::Apply {
                step: i,
                form: step.form(),
                event_id: input.id().to_owned(),
                message,
            };
            let now = current.as_ref().unwrap_or(event);
            if let Step::Function(name) = step {
                for next in host.call(name, now).map_err(fail)? {
                    self.apply_from(i + 1, input, &next, host, out)?;
                }
                return Ok(());
            }
            match apply_step(step, now).map_err(fail)? {
                None => {}
                Some(Output::Event(next)) => current = Some(next),
                Some(body) => {
                    out.push(body);
                    return Ok(());
                }
            }
        }
        out.push(Output::Event(current.unwrap_or_else(|| event.clone())));
        Ok(())
    }

    /// Applies the chain to one event. A chain that calls user functions needs
    /// [`TransformChain::apply_all`]: here its first function step fails.
    pub fn apply(&self, event: &Event) -> Result<Output, TransformError> {
        // `None`: still the input event, not cloned until a step changes it.
        let mut current: Option<Event> = None;
        for (i, step) in self.steps.iter().enumerate() {
            let fail = |message: String| TransformError::Apply {
                step: i,
                form: step.form(),
                event_id: event.id().to_owned(),
                message,
            };
            match apply_step(step, current.as_ref().unwrap_or(event)).map_err(fail)? {
                None => {}
                Some(Output::Event(next)) => current = Some(next),
                Some(body) => return Ok(body),
            }
        }
        Ok(Output::Event(current.unwrap_or_else(|| event.clone())))
    }
}

fn compile_step(v: &Value) -> Result<Step, String> {
    let Value::Object(obj) = v else {
        return Err("a step must be an object with a `form`".into());
    };
    if let Some(name) = obj.get("wasm") {
        if let Some(k) = obj.keys().find(|k| *k != "wasm") {
            return Err(format!(
                "unknown field `{k}` in a function step (it only takes `wasm`)"
            ));
        }
        let name = name
            .as_str()
            .ok_or("`wasm` must be the name of a function")?;
        if name.is_empty() {
            return Err("`wasm` must be the name of a function".into());
        }
        return Ok(Step::Function(name.to_owned()));
    }
    let form = obj
        .get("form")
        .and_then(Value::as_str)
        .ok_or("a step needs a string `form` (or `wasm` naming a function)")?;
    let allowed: &[&str] = match form {
        "ORIGINAL" => &[],
        "CONSTANT" | "JSONPATH" => &["value", "into"],
        "TEMPLATE" => &["value", "template", "into"],
        "SET_ATTRIBUTES" | "REMOVE_ATTRIBUTES" | "RENAME_ATTRIBUTES" => &["attributes"],
        "MAP_DATA" => &["fields", "keep", "remove"],
        other => {
            return Err(format!(
                "unknown form `{other}` (expected ORIGINAL, CONSTANT, JSONPATH, TEMPLATE, \
                 SET_ATTRIBUTES, REMOVE_ATTRIBUTES, RENAME_ATTRIBUTES or MAP_DATA)"
            ))
        }
    };
    if let Some(k) = obj
        .keys()
        .find(|k| *k != "form" && !allowed.contains(&k.as_str()))
    {
        return Err(format!("unknown field `{k}` for form {form}"));
    }
    let into_data = match obj.get("into") {
        None => false,
        Some(Value::String(s)) if s == "data" => true,
        Some(_) => return Err("`into` only accepts \"data\"".into()),
    };
    let field = |name: &str| obj.get(name).ok_or(format!("{form} needs `{name}`"));
    Ok(match form {
        "ORIGINAL" => Step::Original,
        "CONSTANT" => Step::Constant {
            value: field("value")?.clone(),
            into_data,
        },
        "JSONPATH" => Step::JsonPath {
            path: JsonPath::compile(
                field("value")?
                    .as_str()
                    .ok_or("JSONPATH `value` must be a JSONPath string")?,
            )?,
            into_data,
        },
        "TEMPLATE" => {
            let Value::Object(vars) = field("value")? else {
                return Err("TEMPLATE `value` must map variable names to JSONPaths".into());
            };
            let mut names = Vec::new();
            let mut paths = Vec::new();
            for (name, path) in vars {
                let p = path
                    .as_str()
                    .ok_or(format!("variable `{name}` must be a JSONPath string"))?;
                names.push(name.clone());
                paths.push(JsonPath::compile(p)?);
            }
            let text = field("template")?
                .as_str()
                .ok_or("TEMPLATE `template` must be a string")?;
            Step::Template {
                vars: paths,
                template: Template::parse(text, &names)?,
                into_data,
            }
        }
        "SET_ATTRIBUTES" => {
            let Value::Object(attrs) = field("attributes")? else {
                return Err("`attributes` must be an object of name: value".into());
            };
            let mut out = Vec::new();
            for (name, value) in attrs {
                check_attribute_name(name)?;
                if name == "specversion" {
                    return Err("`specversion` cannot be set".into());
                }
                out.push((name.clone(), source(value, name)?));
            }
            Step::SetAttributes(out)
        }
        "REMOVE_ATTRIBUTES" => {
            let Value::Array(names) = field("attributes")? else {
                return Err("`attributes` must be an array of names".into());
            };
            let mut out = Vec::new();
            for n in names {
                let n = n.as_str().ok_or("attribute names must be strings")?;
                check_attribute_name(n)?;
                if REQUIRED.contains(&n) {
                    return Err(format!("`{n}` is required and cannot be removed"));
                }
                out.push(n.to_owned());
            }
            Step::RemoveAttributes(out)
        }
        "RENAME_ATTRIBUTES" => {
            let Value::Object(map) = field("attributes")? else {
                return Err("`attributes` must be an object of old: new".into());
            };
            let mut out = Vec::new();
            for (from, to) in map {
                let to = to.as_str().ok_or("new attribute names must be strings")?;
                check_attribute_name(from)?;
                check_attribute_name(to)?;
                if REQUIRED.contains(&from.as_str()) || to == "specversion" {
                    return Err(format!("`{from}` cannot be renamed to `{to}`"));
                }
                out.push((from.clone(), to.to_owned()));
            }
            Step::RenameAttributes(out)
        }
        _ => {
            let Value::Object(fields) = field("fields")? else {
                return Err("MAP_DATA `fields` must map target paths to sources".into());
            };
            let mut out = Vec::new();
            for (target, src) in fields {
                out.push((dotted(target)?, source(src, target)?));
            }
            let keep = match obj.get("keep") {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => return Err("`keep` must be true or false".into()),
            };
            let remove = match obj.get("remove") {
                None => Vec::new(),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|i| {
                        i.as_str()
                            .ok_or("`remove` holds paths".to_owned())
                            .and_then(dotted)
                    })
                    .collect::<Result<_, _>>()?,
                Some(_) => return Err("`remove` must be an array of paths".into()),
            };
            Step::MapData {
                fields: out,
                keep,
                remove,
            }
        }
    })
}

fn check_attribute_name(name: &str) -> Result<(), String> {
    if !is_attribute_name(name) || NOT_ATTRIBUTES.contains(&name) {
        return Err(format!(
            "`{name}` is not an attribute name (lowercase a-z and 0-9; use MAP_DATA for data)"
        ));
    }
    Ok(())
}

/// A string starting with `$` is a JSONPath; `{"value": x}` is the constant `x`; any other
/// scalar is a constant.
fn source(v: &Value, name: &str) -> Result<Source, String> {
    match v {
        Value::String(s) if s.starts_with('$') => Ok(Source::Path(JsonPath::compile(s)?)),
        Value::Object(o) if o.len() == 1 && o.contains_key("value") => Ok(Source::Const(
            o.get("value").cloned().unwrap_or(Value::Null),
        )),
        Value::Object(_) | Value::Array(_) => Err(format!(
            "`{name}`: use a JSONPath string, a scalar, or {{\"value\": constant}}"
        )),
        scalar => Ok(Source::Const(scalar.clone())),
    }
}

fn dotted(path: &str) -> Result<Vec<String>, String> {
    let segs: Vec<String> = path.split('.').map(str::to_owned).collect();
    if segs.iter().any(String::is_empty) {
        return Err(format!("`{path}` is not a dotted field path like `a.b.c`"));
    }
    Ok(segs)
}

/// The event in structured JSON form, with a JSON payload parsed into `data`.
/// The event in CloudEvents structured JSON form, with JSON data (also JSON held as text
/// or bytes) in place as `data`: what JSONPaths, templates and user functions read.
pub fn structured(event: &Event) -> Result<Value, String> {
    let mut v = serde_json::to_value(event).map_err(|e| format!("cannot serialize event: {e}"))?;
    // A JSON payload is already in place; a string or binary one that holds JSON is parsed.
    if matches!(event.data(), Some(Data::String(_) | Data::Binary(_))) {
        if let (Some(obj), Some(data)) = (v.as_object_mut(), data_json(event)) {
            obj.remove("data_base64");
            obj.insert("data".into(), data.into_owned());
        }
    }
    Ok(v)
}

fn body(value: &Value) -> Output {
    match value {
        Value::String(s) => Output::Body {
            content_type: "text/plain; charset=utf-8".into(),
            bytes: s.as_bytes().to_vec(),
        },
        other => Output::Body {
            content_type: "application/json".into(),
            bytes: other.to_string().into_bytes(),
        },
    }
}

fn with_json_data(event: &Event, value: Value) -> Event {
    let mut event = event.clone();
    event.set_data("application/json", value);
    event
}

/// `Ok(None)` when the step leaves the event as it is.
fn apply_step(step: &Step, event: &Event) -> Result<Option<Output>, String> {
    match step {
        Step::Original => Ok(None),

        other => apply_step_inner(other, event).map(Some),
    }
}

fn apply_step_inner(step: &Step, event: &Event) -> Result<Output, String> {
    match step {
        Step::Original => Ok(Output::Event(event.clone())),
        Step::Function(name) => Err(format!(
            "function `{name}` needs the gateway's function runtime"
        )),
        Step::Constant { value, into_data } => Ok(if *into_data {
            Output::Event(with_json_data(event, value.clone()))
        } else {
            body(value)
        }),
        Step::JsonPath { path, into_data } => {
            let value = Doc::new(event)
                .select(path)?
                .ok_or_else(|| format!("JSONPath `{}` matched nothing", path.source))?;
            Ok(if *into_data {
                Output::Event(with_json_data(event, value))
            } else {
                body(&value)
            })
        }
        Step::Template {
            vars,
            template,
            into_data,
        } => {
            let mut doc = Doc::new(event);
            let values = vars
                .iter()
                .map(|p| doc.select(p))
                .collect::<Result<Vec<_>, _>>()?;
            let rendered = template.render(&values)?;
            match (*into_data, rendered.json) {
                (true, true) => {
                    let v: Value = serde_json::from_str(&rendered.text)
                        .map_err(|e| format!("template output is not JSON: {e}"))?;
                    Ok(Output::Event(with_json_data(event, v)))
                }
                (true, false) => {
                    let mut event = event.clone();
                    event.set_data("text/plain", rendered.text);
                    Ok(Output::Event(event))
                }
                (false, true) => Ok(Output::Body {
                    content_type: "application/json".into(),
                    bytes: rendered.text.into_bytes(),
                }),
                (false, false) => Ok(Output::Body {
                    content_type: "text/plain; charset=utf-8".into(),
                    bytes: rendered.text.into_bytes(),
                }),
            }
        }
        Step::SetAttributes(attrs) => {
            let mut doc = Doc::new(event);
            let mut resolved = Vec::with_capacity(attrs.len());
            for (name, src) in attrs {
                if let Some(v) = src.resolve(&mut doc)? {
                    resolved.push((name, attribute_json(name, v)?));
                }
            }
            // Time and dataschema need parsing and validation: go through the structured form.
            if resolved
                .iter()
                .all(|(n, _)| !matches!(n.as_str(), "time" | "dataschema"))
            {
                return set_directly(event, resolved).map(Output::Event);
            }
            edit_attributes(event, |obj| {
                for (name, v) in resolved {
                    obj.insert(name.clone(), v);
                }
            })
            .map(Output::Event)
        }
        Step::RemoveAttributes(names) => edit_attributes(event, |obj| {
            for n in names {
                obj.remove(n);
            }
        })
        .map(Output::Event),
        Step::RenameAttributes(pairs) => edit_attributes(event, |obj| {
            for (from, to) in pairs {
                if let Some(v) = obj.remove(from) {
                    obj.insert(to.clone(), v);
                }
            }
        })
        .map(Output::Event),
        Step::MapData {
            fields,
            keep,
            remove,
        } => {
            let mut doc = Doc::new(event);
            let current = if *keep { data_json(event) } else { None };
            let mut data = match (keep, event.data(), current.as_deref()) {
                (true, _, Some(Value::Object(m))) => m.clone(),
                (true, None, _) | (true, _, Some(Value::Null)) | (false, _, _) => Map::new(),
                (true, Some(_), _) => {
                    return Err("MAP_DATA with keep needs a JSON object as data".into())
                }
            };
            for path in remove {
                remove_path(&mut data, path);
            }
            for (target, src) in fields {
                if let Some(v) = src.resolve(&mut doc)? {
                    set_path(&mut data, target, v)?;
                }
            }
            Ok(Output::Event(with_json_data(event, Value::Object(data))))
        }
    }
}

const STRING_ATTRIBUTES: [&str; 7] = [
    "id",
    "source",
    "type",
    "subject",
    "time",
    "datacontenttype",
    "dataschema",
];

/// Attribute values are strings, integers or booleans; the core attributes are strings, so
/// a number or boolean taken by JSONPath is written as its text.
fn attribute_json(name: &str, v: Value) -> Result<Value, String> {
    if STRING_ATTRIBUTES.contains(&name) {
        return match v {
            Value::String(_) => Ok(v),
            Value::Number(_) | Value::Bool(_) => Ok(Value::String(v.to_string())),
            other => Err(format!("attribute `{name}` must be a string, not {other}")),
        };
    }
    match &v {
        Value::String(_) | Value::Bool(_) => Ok(v),
        Value::Number(n) if n.is_i64() => Ok(v),
        other => Err(format!(
            "attribute `{name}` must be a string, integer or boolean, not {other}"
        )),
    }
}

/// Sets string attributes and extensions through the SDK, without a JSON round trip.
fn set_directly(event: &Event, values: Vec<(&String, Value)>) -> Result<Event, String> {
    let mut e = event.clone();
    for (name, v) in values {
        match (name.as_str(), v) {
            ("id", Value::String(s)) => {
                e.set_id(s);
            }
            ("source", Value::String(s)) => {
                e.set_source(s);
            }
            ("type", Value::String(s)) => {
                e.set_type(s);
            }
            ("subject", Value::String(s)) => {
                e.set_subject(Some(s));
            }
            ("datacontenttype", Value::String(s)) => {
                e.set_datacontenttype(Some(s));
            }
            (ext, Value::String(s)) if !STRING_ATTRIBUTES.contains(&ext) => e.set_extension(ext, s),
            (ext, Value::Bool(b)) if !STRING_ATTRIBUTES.contains(&ext) => e.set_extension(ext, b),
            (ext, Value::Number(n)) if !STRING_ATTRIBUTES.contains(&ext) => match n.as_i64() {
                Some(i) => e.set_extension(ext, i),
                None => return Err(format!("attribute `{ext}` must be an integer, not {n}")),
            },
            (other, v) => return Err(format!("attribute `{other}` cannot hold {v}")),
        }
    }
    Ok(e)
}

/// Edits the attributes through the structured form; the payload is carried over as is.
fn edit_attributes(
    event: &Event,
    edit: impl FnOnce(&mut Map<String, Value>),
) -> Result<Event, String> {
    let data = event.data().cloned();
    let mut v = serde_json::to_value(event).map_err(|e| format!("cannot serialize event: {e}"))?;
    let Some(obj) = v.as_object_mut() else {
        return Err("event did not serialize to an object".into());
    };
    obj.remove("data");
    obj.remove("data_base64");
    edit(obj);
    let mut out: Event = serde_json::from_value(v)
        .map_err(|e| format!("the result is not a valid CloudEvent: {e}"))?;
    if let Some(d) = data {
        out.set_data_unchecked(d);
    }
    Ok(out)
}

fn set_path(root: &mut Map<String, Value>, path: &[String], value: Value) -> Result<(), String> {
    let Some((last, parents)) = path.split_last() else {
        return Ok(());
    };
    let mut map = root;
    for key in parents {
        let entry = map
            .entry(key.clone())
            .or_insert_with(|| Value::Object(Map::new()));
        if !entry.is_object() {
            *entry = Value::Object(Map::new());
        }
        map = match entry {
            Value::Object(m) => m,
            _ => return Err(format!("cannot descend into `{key}`")),
        };
    }
    map.insert(last.clone(), value);
    Ok(())
}

fn remove_path(root: &mut Map<String, Value>, path: &[String]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut map = root;
    for key in parents {
        match map.get_mut(key) {
            Some(Value::Object(m)) => map = m,
            _ => return,
        }
    }
    map.remove(last);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Plain paths resolved directly give exactly what jsonpath-rust gives on the
    /// structured form.
    #[test]
    fn simple_paths_agree_with_jsonpath() {
        let mut events: Vec<Event> = Vec::new();
        let base = json!({
            "specversion": "1.0", "id": "1", "source": "/s", "type": "t", "subject": "sub",
            "time": "2024-05-01T10:00:00Z", "region": "eu", "n": 5, "flag": true,
            "datacontenttype": "application/json",
            "data": {"a": {"b": [1, {"c": "x"}]}, "k-1": null, "s": "str"}
        });
        events.push(serde_json::from_value(base.clone()).unwrap());
        let mut text = base.clone();
        text["datacontenttype"] = json!("text/plain");
        text["data"] = json!("plain text");
        events.push(serde_json::from_value(text).unwrap());
        let mut no_data = base;
        no_data.as_object_mut().unwrap().remove("data");
        events.push(serde_json::from_value(no_data).unwrap());
        let mut string_json: Event = events[0].clone();
        string_json.set_data("application/json", "{\"a\": {\"b\": [7]}}".to_string());
        events.push(string_json);

        let paths = [
            "$.data",
            "$.data.a",
            "$.data.a.b",
            "$.data.a.b[0]",
            "$.data.a.b[1].c",
            "$.data.a.b[5]",
            "$.data['a']['b']",
            "$.data['k-1']",
            "$.data[\"a\"]['b'][1]",
            "$['type']",
            "$.data.s",
            "$.data.s.x",
            "$.data.nope",
            "$.type",
            "$.id",
            "$.source",
            "$.subject",
            "$.time",
            "$.region",
            "$.n",
            "$.flag",
            "$.missing",
            "$.type.x",
            "$.specversion",
            "$.datacontenttype",
        ];
        for ev in &events {
            let doc = structured(ev).unwrap();
            for p in paths {
                let jp = JsonPath::compile(p).unwrap();
                let simple = jp.simple.as_deref().expect(p);
                let direct = select_simple(simple, ev).expect(p);
                assert_eq!(direct, jp.select(&doc).unwrap(), "{p} on {ev}");
            }
        }
        for p in [
            "$",
            "$..b",
            "$.data[*]",
            "$.data.a.b[-1]",
            "$.data_base64",
            "$.data[?@.s]",
        ] {
            let jp = JsonPath::compile(p).unwrap();
            assert!(jp.simple.is_none(), "{p}");
        }
    }
}
