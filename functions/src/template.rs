//! The template engine of the `TEMPLATE` transform: `${name}` placeholders substituted
//! JSON-aware, in the style of the EventBridge input transformer.
//!
//! A template whose text starts (after whitespace) with `{` or `[` is a JSON template: a
//! placeholder outside a JSON string is replaced by the variable's JSON value (a string is
//! quoted and escaped, a missing value is `null`); a placeholder inside a JSON string is
//! replaced by the value's text escaped for that string (a missing value is empty), and the
//! result must be valid JSON. Any other template is plain text: strings are inserted raw,
//! other values as JSON text, missing values as nothing.

use serde_json::Value;

/// Any JSON value, read as a parser building it would read it: unlike `IgnoredAny`, string
/// escapes are decoded, so a lone surrogate (`"\ud800"`, which a template's literal text can
/// hold) is refused instead of rendering text no JSON reader takes. Builds nothing.
struct Strict;

impl<'de> serde::Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Strict, D::Error> {
        use serde::de::{MapAccess, SeqAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Strict;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_bool<E>(self, _: bool) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_str<E>(self, _: &str) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_unit<E>(self) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strict, A::Error> {
                while seq.next_element::<Strict>()?.is_some() {}
                Ok(Strict)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Strict, A::Error> {
                while map.next_entry::<Strict, Strict>()?.is_some() {}
                Ok(Strict)
            }
        }
        d.deserialize_any(V)
    }
}

/// A parsed template.
#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    parts: Vec<Part>,
    json: bool,
}

#[derive(Debug, Clone, PartialEq)]
enum Part {
    Lit(String),
    Var { index: usize, in_string: bool },
}

/// A rendered template.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// The text produced.
    pub text: String,
    /// Whether it is a JSON template (its text is then valid JSON).
    pub json: bool,
}

impl Template {
    /// Parses `text`; every placeholder must name one of `vars`.
    pub fn parse(text: &str, vars: &[String]) -> Result<Template, String> {
        let json = matches!(text.trim_start().chars().next(), Some('{' | '['));
        let mut parts = Vec::new();
        let mut lit = String::new();
        let mut in_string = false;
        let mut escaped = false;
        let mut rest = text;
        while let Some(c) = rest.chars().next() {
            if let Some(after) = rest.strip_prefix("${") {
                let Some(end) = after.find('}') else {
                    return Err("unterminated `${` placeholder".into());
                };
                let name = after.get(..end).unwrap_or_default();
                let Some(index) = vars.iter().position(|v| v == name) else {
                    return Err(format!("placeholder `${{{name}}}` names no variable"));
                };
                if !lit.is_empty() {
                    parts.push(Part::Lit(std::mem::take(&mut lit)));
                }
                parts.push(Part::Var {
                    index,
                    in_string: json && in_string,
                });
                rest = after.get(end + 1..).unwrap_or_default();
                escaped = false;
                continue;
            }
            if json {
                if in_string {
                    if escaped {
                        escaped = false;
                    } else if c == '\\' {
                        escaped = true;
                    } else if c == '"' {
                        in_string = false;
                    }
                } else if c == '"' {
                    in_string = true;
                }
            }
            lit.push(c);
            rest = rest.get(c.len_utf8()..).unwrap_or_default();
        }
        if !lit.is_empty() {
            parts.push(Part::Lit(lit));
        }
        Ok(Template { parts, json })
    }

    /// Whether this is a JSON template.
    pub fn is_json(&self) -> bool {
        self.json
    }

    /// Renders with `values[i]` for variable `i` (`None` when the variable matched nothing).
    pub fn render(&self, values: &[Option<Value>]) -> Result<Rendered, String> {
        let mut text = String::new();
        for part in &self.parts {
            match part {
                Part::Lit(s) => text.push_str(s),
                Part::Var { index, in_string } => {
                    let v = values.get(*index).and_then(Option::as_ref);
                    match (self.json, in_string, v) {
                        (true, false, None) => text.push_str("null"),
                        (true, false, Some(v)) => text.push_str(&v.to_string()),
                        (true, true, None) | (false, _, None) => {}
                        (true, true, Some(v)) => {
                            let raw = match v {
                                Value::String(s) => s.clone(),
                                other => other.to_string(),
                            };
                            let quoted = Value::String(raw).to_string();
                            let inner = quoted
                                .get(1..quoted.len().saturating_sub(1))
                                .unwrap_or_default();
                            text.push_str(inner);
                        }
                        (false, _, Some(Value::String(s))) => text.push_str(s),
                        (false, _, Some(other)) => text.push_str(&other.to_string()),
                    }
                }
            }
        }
        if self.json {
            if let Err(e) = serde_json::from_str::<Strict>(&text) {
                return Err(format!("the JSON template did not render valid JSON: {e}"));
            }
        }
        Ok(Rendered {
            text,
            json: self.json,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by fuzzing (`template`): a lone surrogate escape in the template's literal text
    /// passed the check and rendered JSON that no JSON reader (the receiver, the JSON-lines
    /// targets) takes.
    #[test]
    fn a_json_template_with_a_lone_surrogate_does_not_render() {
        let vars = vec!["a".to_string()];
        let t = Template::parse(r#"{"text": "hi $\ud800{a}", "n": ${a}}"#, &vars).unwrap();
        assert!(t.render(&[Some(Value::from(1))]).is_err());
        // A surrogate pair is fine.
        let t = Template::parse(r#"{"text": "\ud83d\ude00 ${a}"}"#, &vars).unwrap();
        let r = t.render(&[Some(Value::from("x"))]).unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&r.text).unwrap()["text"],
            "\u{1F600} x"
        );
    }
}
