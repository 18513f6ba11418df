//! A Sluice function that does what a JSONPath template cannot: it looks the order's
//! country up in a code table and decides by logic what to pass on.
//!
//! - `data.country` (ISO 3166 alpha-2) is looked up: the event gets the extension
//!   attribute `region` and `data.countryName`, and `data.vat` (the VAT on
//!   `data.amount` at the country's standard rate, rounded to cents);
//! - test orders (`data.test == true`) and orders under the country's minimum amount
//!   are dropped (an empty list);
//! - an unknown or missing country is an error: the gateway dead-letters the event with
//!   the message as the reason.
//!
//! The contract is schemas/wit/function.wit: `handle` gets one CloudEvent in the JSON
//! structured format and returns the events to pass on.

use serde_json::{Map, Value};

wit_bindgen::generate!({
    path: "../../../schemas/wit/function.wit",
    world: "transform",
});

/// Country code, name, region, standard VAT rate in percent, minimum amount.
const COUNTRIES: &[(&str, &str, &str, u32, f64)] = &[
    ("AT", "Austria", "emea", 20, 1.0),
    ("BE", "Belgium", "emea", 21, 1.0),
    ("DE", "Germany", "emea", 19, 1.0),
    ("ES", "Spain", "emea", 21, 1.0),
    ("FR", "France", "emea", 20, 1.0),
    ("IT", "Italy", "emea", 22, 1.0),
    ("NL", "Netherlands", "emea", 21, 1.0),
    ("CH", "Switzerland", "emea", 8, 5.0),
    ("GB", "United Kingdom", "emea", 20, 1.0),
    ("JP", "Japan", "apac", 10, 5.0),
    ("AU", "Australia", "apac", 10, 5.0),
    ("US", "United States", "amer", 0, 5.0),
    ("CA", "Canada", "amer", 5, 5.0),
];

struct Function;

impl Guest for Function {
    fn handle(event: String) -> Result<Vec<String>, String> {
        let mut event: Map<String, Value> = serde_json::from_str(&event)
            .map_err(|e| format!("the event is not a JSON object: {e}"))?;
        let id = event
            .get("id")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let Some(Value::Object(data)) = event.get_mut("data") else {
            return Err(format!("data of event {id} is not a JSON object"));
        };
        if data.get("test") == Some(&Value::Bool(true)) {
            return Ok(vec![]);
        }
        let code = data.get("country").and_then(Value::as_str).unwrap_or("");
        let Some(&(_, name, region, vat, minimum)) = COUNTRIES
            .iter()
            .find(|(c, ..)| c.eq_ignore_ascii_case(code))
        else {
            return Err(format!("event {id}: unknown country code {code:?}"));
        };
        if let Some(amount) = data.get("amount").and_then(Value::as_f64) {
            if amount < minimum {
                return Ok(vec![]);
            }
            let vat = (amount * f64::from(vat)).round() / 100.0;
            data.insert("vat".into(), vat.into());
        }
        data.insert("countryName".into(), name.into());
        event.insert("region".into(), region.into());
        Ok(vec![Value::Object(event).to_string()])
    }
}

export!(Function);
