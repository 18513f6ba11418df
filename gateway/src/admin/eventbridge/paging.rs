//! Lists in pages as the project pages them: `nextToken` is an offset, `maxResults` 1 to
//! 100 (`NextTokenUtil`).

use serde_json::{Map, Value};

use crate::admin::eventbridge::dto::{field, kind_of, EbError};

/// The most entries a list answers with (the project's SDK: "Up to 100 entries").
const MAX_RESULTS: i64 = 100;
/// The page size when the request names none.
const DEFAULT_RESULTS: i64 = 10;

/// `nextToken` (an offset, "0" when absent) and `maxResults` (1 to 100, 10 when absent).
pub(super) fn paging(map: &Map<String, Value>) -> Result<(usize, usize), EbError> {
    let token = match field(map, "nextToken") {
        None => 0,
        Some(Value::String(s)) if s.is_empty() => 0,
        Some(Value::String(s)) => s.parse::<usize>().map_err(|_| {
            EbError::new(
                "NextTokenInvalid",
                format!("The next token of page is invalid. which should be a token a list answered, not [{}].", s.chars().take(64).collect::<String>()),
            )
        })?,
        Some(Value::Number(n)) => n.as_u64().map(|n| n as usize).ok_or_else(|| {
            EbError::new("NextTokenInvalid", "The next token of page is invalid.")
        })?,
        Some(other) => {
            return Err(EbError::new(
                "NextTokenInvalid",
                format!(
                    "The next token of page is invalid: a string is expected, not {}.",
                    kind_of(other)
                ),
            ))
        }
    };
    let max = match field(map, "maxResults") {
        None => DEFAULT_RESULTS,
        Some(Value::Number(n)) => n.as_i64().unwrap_or(-1),
        // Jackson reads "10" as 10.
        Some(Value::String(s)) => s.trim().parse::<i64>().unwrap_or(-1),
        Some(_) => -1,
    };
    if !(1..=MAX_RESULTS).contains(&max) {
        return Err(EbError::new(
            "LimitSizeInvalid",
            format!(
                "The limit size of page is invalid, which must greater than 0 and less than [{}].",
                MAX_RESULTS + 1
            ),
        ));
    }
    Ok((token, max as usize))
}

/// One page of `items` and the token of the next (`NextTokenUtil.findNextToken`).
pub(super) fn page<T>(items: Vec<T>, token: usize, max: usize) -> (Vec<T>, Option<String>, usize) {
    let total = items.len();
    let next = (token.saturating_add(max) < total).then(|| (token + max).to_string());
    let page = items.into_iter().skip(token).take(max).collect();
    (page, next, total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pages_follow_next_token_util() {
        let (items, next, total) = page((0..5).collect::<Vec<_>>(), 0, 2);
        assert_eq!((items, next.as_deref(), total), (vec![0, 1], Some("2"), 5));
        let (items, next, _) = page((0..5).collect::<Vec<_>>(), 4, 2);
        assert_eq!((items, next), (vec![4], None));
        let (items, next, _) = page((0..5).collect::<Vec<_>>(), 99, 2);
        assert_eq!((items, next), (Vec::<i32>::new(), None));
    }

    #[test]
    fn paging_refuses_what_the_project_refuses() {
        let map = |v: Value| v.as_object().cloned().unwrap_or_default();
        assert_eq!(paging(&map(json!({}))).ok(), Some((0, 10)));
        assert_eq!(
            paging(&map(json!({"nextToken": "4", "maxResults": "3"}))).ok(),
            Some((4, 3))
        );
        for bad in [
            json!({"maxResults": 0}),
            json!({"maxResults": 101}),
            json!({"maxResults": true}),
        ] {
            assert_eq!(
                paging(&map(bad)).err().map(|e| e.code),
                Some("LimitSizeInvalid")
            );
        }
        for bad in [
            json!({"nextToken": "x"}),
            json!({"nextToken": -1}),
            json!({"nextToken": []}),
        ] {
            assert_eq!(
                paging(&map(bad)).err().map(|e| e.code),
                Some("NextTokenInvalid")
            );
        }
    }
}
