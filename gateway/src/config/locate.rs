//! Where an error is in a configuration text: the line of a key (`line_of`, `key_line`,
//! `find_line`), the key inside a nested table that serde reports only as the whole table
//! (`nested`), and `from_json`, which reads an admin API resource with the configuration's
//! own deserializer so its errors name the field by JSON pointer.

/// Where in a nested table an error is. Targets are internally tagged (`type = "http"`), and
/// serde reads a tagged table through a buffer that drops the positions: an error anywhere
/// inside a `[[rules.targets]]` entry (a dead-letter `target` without `name`, an unknown key
/// of its retry table) comes back spanning the whole entry. This finds, inside that entry,
/// the key or table the message is about and reports its line instead.
pub(crate) mod nested {
    use std::ops::Range;

    use toml::de::{DeTable, DeValue};
    use toml::Spanned;

    /// A better-placed message than the parser's, when the error is about a whole table.
    pub(crate) fn locate(text: &str, error: &toml::de::Error) -> Option<String> {
        let span = error.span()?;
        let root = DeTable::parse(text).ok()?;
        // Table-level errors carry the table's span (for `[[rules.targets]]`, its header).
        let element = table_at(root.get_ref(), &span)?;
        let message = error.message();
        let mut found = None;
        visit_table(element, message, false, 0, &mut found);
        if found.is_none() {
            // Parsers quote part of a value (the unit of `3 fortnights`): look for it inside.
            visit_table(element, message, true, 0, &mut found);
        }
        let (at, _) = found?;
        Some(render(text, at, message))
    }

    /// The JSON pointer of where an error is in `text` (written by `from_json`: one inline
    /// value per key, so each field has its own span): the deepest key or value whose span
    /// holds the error's, refined inside a tagged table the way `locate` does.
    pub(super) fn pointer(text: &str, error: &toml::de::Error) -> Option<String> {
        let mut span = error.span()?;
        let root = DeTable::parse(text).ok()?;
        // Errors inside tagged tables come back spanning the table, or the whole array
        // of them: look inside for what the message is about.
        if let Some(element) = root.get_ref().iter().find_map(|(_, v)| value_at(v, &span)) {
            for partial in [false, true] {
                let mut found = None;
                visit_value(element, error.message(), partial, 0, &mut found);
                if let Some((at, _)) = found {
                    span = at;
                    break;
                }
            }
        }
        let mut path = Vec::new();
        walk_table(root.get_ref(), &span, &mut path);
        Some(
            path.iter()
                .map(|p| format!("/{}", p.replace('~', "~0").replace('/', "~1")))
                .collect(),
        )
    }

    /// The table or array (at any depth) whose span is `span`.
    fn value_at<'a, 'i>(
        value: &'a Spanned<DeValue<'i>>,
        span: &Range<usize>,
    ) -> Option<&'a Spanned<DeValue<'i>>> {
        match value.get_ref() {
            DeValue::Table(_) | DeValue::Array(_) if value.span() == *span => Some(value),
            DeValue::Table(t) => t.iter().find_map(|(_, v)| value_at(v, span)),
            DeValue::Array(items) => items.iter().find_map(|i| value_at(i, span)),
            _ => None,
        }
    }

    fn walk_table(table: &DeTable<'_>, span: &Range<usize>, path: &mut Vec<String>) {
        for (key, value) in table {
            let holds = |r: Range<usize>| r.start <= span.start && span.end <= r.end;
            if holds(key.span()) {
                path.push(key.get_ref().to_string());
                return;
            }
            if holds(value.span()) {
                path.push(key.get_ref().to_string());
                walk_value(value, span, path);
                return;
            }
        }
    }

    fn walk_value(value: &Spanned<DeValue<'_>>, span: &Range<usize>, path: &mut Vec<String>) {
        match value.get_ref() {
            DeValue::Table(t) => walk_table(t, span, path),
            DeValue::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    let r = item.span();
                    if r.start <= span.start && span.end <= r.end {
                        path.push(i.to_string());
                        walk_value(item, span, path);
                        return;
                    }
                }
            }
            _ => {}
        }
    }

    /// The table (at any depth) whose span is `span`.
    fn table_at<'a, 'i>(table: &'a DeTable<'i>, span: &Range<usize>) -> Option<&'a DeTable<'i>> {
        table
            .iter()
            .find_map(|(_, value)| value_table_at(value, span))
    }

    fn value_table_at<'a, 'i>(
        value: &'a Spanned<DeValue<'i>>,
        span: &Range<usize>,
    ) -> Option<&'a DeTable<'i>> {
        match value.get_ref() {
            DeValue::Table(t) if value.span() == *span => Some(t),
            DeValue::Table(t) => table_at(t, span),
            DeValue::Array(items) => items.iter().find_map(|i| value_table_at(i, span)),
            _ => None,
        }
    }

    /// The word a message is about: the first back-quoted one (`unknown field `x``, a bad
    /// value), else the first double-quoted one (`invalid type: string "x"`).
    fn subject(message: &str) -> Option<&str> {
        message
            .split('`')
            .nth(1)
            .or_else(|| message.split('"').nth(1))
    }

    /// A scalar's text as a message would quote it.
    fn scalar_text<'a>(value: &'a DeValue<'_>) -> Option<&'a str> {
        match value {
            DeValue::String(s) => Some(s),
            DeValue::Integer(i) => Some(i.as_str()),
            DeValue::Float(f) => Some(f.as_str()),
            _ => None,
        }
    }

    /// Keeps in `found` the deepest key or value inside `table` that the message is about:
    /// for `missing field `x``, a nested tagged table (one with `type`) that lacks `x`.
    /// `partial`: a string value containing the word counts too.
    fn visit_table(
        table: &DeTable<'_>,
        message: &str,
        partial: bool,
        depth: usize,
        found: &mut Option<(Range<usize>, usize)>,
    ) {
        let keep = |at: Range<usize>, found: &mut Option<(Range<usize>, usize)>| {
            if found.as_ref().is_none_or(|(_, d)| depth + 1 > *d) {
                *found = Some((at, depth + 1));
            }
        };
        let missing = message
            .strip_prefix("missing field ")
            .and_then(|_| subject(message));
        let word = subject(message);
        for (key, value) in table {
            match (missing, value.get_ref()) {
                (Some(field), DeValue::Table(t)) => {
                    if t.contains_key("type") && !t.contains_key(field) {
                        keep(key.span(), found);
                    }
                }
                (Some(_), _) => {}
                (None, v) => {
                    if word == Some(key.get_ref().as_ref()) {
                        keep(key.span(), found);
                    } else if let (Some(word), Some(text)) = (word, scalar_text(v)) {
                        if text == word || (partial && !word.is_empty() && text.contains(word)) {
                            keep(value.span(), found);
                        }
                    }
                }
            }
            visit_value(value, message, partial, depth + 1, found);
        }
    }

    fn visit_value(
        value: &Spanned<DeValue<'_>>,
        message: &str,
        partial: bool,
        depth: usize,
        found: &mut Option<(Range<usize>, usize)>,
    ) {
        match value.get_ref() {
            DeValue::Table(t) => visit_table(t, message, partial, depth, found),
            DeValue::Array(items) => {
                for item in items.iter() {
                    visit_value(item, message, partial, depth, found);
                }
            }
            _ => {}
        }
    }

    /// The parser's own layout: position, the line with a marker, the message.
    fn render(text: &str, at: Range<usize>, message: &str) -> String {
        let start = at.start.min(text.len());
        let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
        let line_end = text[start..].find('\n').map_or(text.len(), |i| start + i);
        let line_no = text[..start].matches('\n').count() + 1;
        let column = text[line_start..start].chars().count() + 1;
        let width = text[start..at.end.min(line_end).max(start)]
            .chars()
            .count()
            .max(1);
        let gutter = " ".repeat(line_no.to_string().len());
        format!(
            "TOML parse error at line {line_no}, column {column}\n{gutter} |\n{line_no} | {}\n{gutter} | {}{}\n{message}",
            &text[line_start..line_end],
            " ".repeat(column - 1),
            "^".repeat(width),
        )
    }
}

/// Reads a resource (a bus, a rule, a source, or a set of them) from JSON with the
/// configuration file's own deserializer: the JSON is written as TOML with inline tables
/// (every value keeps its own position) and parsed as a configuration file is. An error
/// names the field at fault as a JSON pointer.
pub fn from_json<T: serde::de::DeserializeOwned>(
    value: &serde_json::Value,
) -> Result<T, (String, String)> {
    let serde_json::Value::Object(map) = value else {
        return Err((String::new(), "expected a JSON object".to_string()));
    };
    let mut text = String::new();
    for (key, value) in map {
        if value.is_null() {
            continue;
        }
        text.push_str(&toml_key(key));
        text.push_str(" = ");
        toml_value(value, &mut text);
        text.push('\n');
    }
    toml::from_str(&text).map_err(|e| {
        let pointer = nested::pointer(&text, &e).unwrap_or_default();
        (pointer, e.message().trim_end().to_string())
    })
}

fn toml_key(key: &str) -> String {
    serde_json::to_string(key).unwrap_or_else(|_| "\"\"".to_string())
}

/// JSON as an inline TOML value (JSON string escapes are TOML basic-string escapes). Nulls
/// inside objects mean "absent".
fn toml_value(value: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    match value {
        Value::Null => out.push_str("{}"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            let text = n.to_string();
            if n.is_f64() && !text.contains(['.', 'e', 'E']) {
                out.push_str(&format!("{text}.0"));
            } else {
                out.push_str(&text);
            }
        }
        Value::String(s) => out.push_str(&serde_json::to_string(s).unwrap_or_default()),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                toml_value(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            let mut first = true;
            for (key, value) in map.iter().filter(|(_, v)| !v.is_null()) {
                if !first {
                    out.push_str(", ");
                }
                first = false;
                out.push_str(&toml_key(key));
                out.push_str(" = ");
                toml_value(value, out);
            }
            out.push('}');
        }
    }
}

pub(crate) fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset)
        .map_or(1, |t| t.matches('\n').count() + 1)
}

/// The line of `key` inside the `[table]` section (or a dotted `table.key`), else of the
/// section header, else 1.
pub(crate) fn key_line(text: &str, table: &str, key: &str) -> usize {
    let header = format!("[{table}]");
    let dotted = format!("{table}.{key}");
    let mut in_table = false;
    let mut header_line = None;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_start();
        if line.starts_with('[') {
            in_table = line.starts_with(&header);
            if in_table {
                header_line = Some(i + 1);
            }
            continue;
        }
        let is_key = |k: &str| {
            line.strip_prefix(k)
                .is_some_and(|rest| rest.trim_start().starts_with('='))
        };
        if (in_table && is_key(key)) || (header_line.is_none() && is_key(&dotted)) {
            return i + 1;
        }
    }
    header_line.unwrap_or(1)
}

pub(crate) fn find_line(text: &str, key: &str) -> usize {
    text.lines()
        .position(|l| l.trim_start().starts_with(key))
        .map_or(1, |i| i + 1)
}
