//! The one way an event enters a bus from a request: parsed entries (`entry`) are stored
//! (`store`), or stored at most once per dedup key (`store_unique`); bodies are read under
//! their limit (`read_body`); failures become problems (`event_problem`, `store_problem`).
//! CloudEvents ingress and webhook sources both go through it.

use std::time::Duration;

use axum::body::Body;

use axum::http::header;
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::event::http as cloudevent;
use crate::event::{ErrorKind, EventError};
use crate::ingress::limits::Limits;
use crate::problem::Problem;
use crate::store::append::{append, prepare, Prepared};
use crate::store::dedup::Dedup;
use crate::store::dedup::Reserve;
use crate::store::{BusLog, StoreError, Unique};

/// The body length a request declares (`Content-Length`), for its metrics; 0 when absent.
pub(crate) fn declared_length(headers: &http::HeaderMap) -> u64 {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
}

/// One entry of a request: a parsed event or the reason it was refused.
pub(crate) type Entry = Result<(String, Bytes, u32), EventError>;

/// The store result of each entry (`None`: not stored, it is an error or a duplicate).
pub(crate) type Stored = Vec<Option<Result<(), StoreError>>>;

/// Stores the entries of a request to a deduplicating bus or webhook source: an entry with
/// a key is stored at most once per key within `window` (`true` in the second vector when
/// it was a duplicate, answered as accepted but not stored again), and its key is recorded
/// only once it is stored, so that a failed store never turns the producer's retry into a
/// "duplicate". Where the log can record keys with its records in one atomic step (Redis:
/// one round trip per shard) it does; otherwise each key is reserved through `dedup`,
/// the event stored, and the key confirmed (or released when the store failed). A key
/// held by another request still deciding is answered as busy (retry shortly). `Err` when
/// the dedup store could not be asked (nothing was stored).
pub(crate) async fn store_unique(
    log: &dyn BusLog,
    dedup: &dyn crate::store::dedup::Dedup,
    entries: &[Entry],
    keys: &[Option<String>],
    window: Duration,
) -> Result<(Stored, Vec<bool>), StoreError> {
    let mut duplicates = vec![false; entries.len()];
    let mut seen = std::collections::HashSet::new();
    // The entries stored under a key, per shard, in request order; the others plainly.
    let mut unique: Vec<(u32, Vec<usize>)> = Vec::new();
    let mut plain: Vec<Entry> = vec![Err(EventError::invalid("id", "not stored")); entries.len()];
    for (i, entry) in entries.iter().enumerate() {
        let Ok((_, _, shard)) = entry else { continue };
        match keys.get(i).and_then(Option::as_deref) {
            // The same event twice in one request: the first is stored, the others are
            // duplicates.
            Some(key) if !seen.insert(key) => duplicates[i] = true,
            Some(_) => match unique.iter_mut().find(|(s, _)| s == shard) {
                Some((_, list)) => list.push(i),
                None => unique.push((*shard, vec![i])),
            },
            None => plain[i] = entry.clone(),
        }
    }
    let mut stored: Stored = vec![None; entries.len()];
    let mut atomic = true;
    for (shard, list) in &unique {
        let records: Vec<(Bytes, &str)> = list
            .iter()
            .filter_map(|i| {
                let (_, bytes, _) = entries[*i].as_ref().ok()?;
                Some((bytes.clone(), keys[*i].as_deref()?))
            })
            .collect();
        match log.append_unique(*shard, &records, window).await {
            None => {
                atomic = false;
                break;
            }
            Some(Ok(results)) => {
                for (i, result) in list.iter().zip(results) {
                    match result {
                        Unique::Stored(_) => stored[*i] = Some(Ok(())),
                        Unique::Duplicate => duplicates[*i] = true,
                        Unique::Busy => stored[*i] = Some(Err(busy_key())),
                    }
                }
            }
            Some(Err(e)) => {
                for i in list {
                    stored[*i] = Some(Err(e.clone()));
                }
            }
        }
    }
    if !atomic {
        for (_, list) in &unique {
            for i in list {
                plain[*i] = entries[*i].clone();
            }
        }
        return reserve_and_store(log, dedup, &plain, keys, window, duplicates).await;
    }
    for (i, result) in store(log, &plain).await.into_iter().enumerate() {
        if result.is_some() {
            stored[i] = result;
        }
    }
    Ok((stored, duplicates))
}

fn busy_key() -> StoreError {
    StoreError::Busy(
        "an event with this id is being stored by another request; retry shortly".to_string(),
    )
}

/// `store_unique` for a log without atomic dedup: reserve each key, store what is not a
/// duplicate, then keep (or drop) the records.
async fn reserve_and_store(
    log: &dyn BusLog,
    dedup: &dyn crate::store::dedup::Dedup,
    entries: &[Entry],
    keys: &[Option<String>],
    window: Duration,
    mut duplicates: Vec<bool>,
) -> Result<(Stored, Vec<bool>), StoreError> {
    use crate::store::dedup::Reserve;
    // Held by another request still undecided: not stored now, retried by the producer.
    let mut busy = vec![false; entries.len()];
    let mut tokens: Vec<Option<(&str, String)>> = vec![None; entries.len()];
    for (i, entry) in entries.iter().enumerate() {
        let (Some(key), Ok(_)) = (keys.get(i).and_then(Option::as_deref), entry) else {
            continue;
        };
        match reserve(dedup, key).await {
            Ok(Reserve::Taken(token)) => tokens[i] = Some((key, token)),
            Ok(Reserve::Duplicate) => duplicates[i] = true,
            Ok(Reserve::InFlight) => busy[i] = true,
            Err(e) => {
                for (key, token) in tokens.iter().flatten() {
                    let _ = dedup.release(key, token).await;
                }
                return Err(e);
            }
        }
    }
    let to_store: Vec<Entry> = entries
        .iter()
        .enumerate()
        .map(|(i, e)| match e {
            Ok(_) if duplicates[i] || busy[i] => Err(EventError::invalid("id", "not stored")),
            _ => e.clone(),
        })
        .collect();
    let mut stored = store(log, &to_store).await;
    for (i, held) in busy.iter().enumerate() {
        if *held {
            stored[i] = Some(Err(busy_key()));
        }
    }
    for (i, token) in tokens.iter().enumerate() {
        let Some((key, token)) = token else { continue };
        let result = if matches!(stored[i], Some(Ok(()))) {
            dedup.confirm(key, token, window).await
        } else {
            dedup.release(key, token).await
        };
        if let Err(e) = result {
            tracing::warn!(key = %key, error = %e, "cannot record a dedup key");
        }
    }
    Ok((stored, duplicates))
}

/// A parsed event made ready for the store: size and read-back checked, its shard chosen.
/// Webhook sources store through this too.
pub(crate) fn entry(
    parsed: Result<cloudevent::Parsed, EventError>,
    shards: u32,
    limits: &Limits,
) -> Entry {
    let cloudevent::Parsed {
        event,
        stored,
        reads_back,
    } = parsed?;
    let (shard, bytes) = prepare(
        &event,
        stored,
        reads_back,
        shards,
        limits.max_event_bytes,
        "limits.max_event_bytes",
    )?;
    Ok((
        cloudevents::AttributesReader::id(&event).to_string(),
        bytes,
        shard,
    ))
}

/// Reads a request's body to its end (up to `limit`) and drops it chunk by chunk, holding
/// nothing: a client still sending its body then reads the answer instead of losing the
/// connection under it.
pub(crate) async fn discard_body(body: Body, limit: usize) {
    let mut body = Limited::new(body, limit);
    while let Some(Ok(_)) = body.frame().await {}
}

pub(crate) async fn read_body(
    headers: &http::HeaderMap,
    body: Body,
    limit: usize,
    limit_name: &str,
) -> Result<Bytes, Problem> {
    let too_large = |size: String| {
        Problem::too_large(
            limit_name,
            format!("the request body is {size}; at most {limit} bytes are accepted here"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(len) = declared.filter(|len| *len > limit as u64) {
        return Err(too_large(format!("{len} bytes")));
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(too_large("larger".to_string()))
        }
        Err(e) => Err(Problem::bad_request(
            "body",
            format!("the request body could not be read to its end: {e}"),
        )),
    }
}

/// Appends the valid entries, grouped by shard so each shard gets one append per request.
/// Returns, per entry, whether it was stored (`None` for entries that were invalid).
pub(crate) async fn store(
    log: &dyn BusLog,
    entries: &[Entry],
) -> Vec<Option<Result<(), StoreError>>> {
    let records: Vec<Option<Prepared>> = entries
        .iter()
        .map(|e| {
            e.as_ref()
                .ok()
                .map(|(_, bytes, shard)| (*shard, bytes.clone()))
        })
        .collect();
    append(log, &records).await
}

pub(crate) fn event_problem(e: EventError) -> Problem {
    match e.kind {
        ErrorKind::Invalid => Problem::invalid_event(e.field, e.message),
        ErrorKind::TooLarge => Problem::too_large(&e.field, e.message),
        ErrorKind::Unsupported => Problem::unsupported_media_type(e.message),
    }
}

pub(crate) fn store_problem(e: &StoreError) -> Problem {
    match e {
        StoreError::Busy(m) => Problem::unavailable(m.clone(), 1),
        StoreError::TooLarge(m) => Problem::too_large("limits.max_event_bytes", m.clone()),
        StoreError::Unavailable(m) | StoreError::Corrupt(m) => Problem::unavailable(
            format!("the event could not be stored ({m}); nothing was kept"),
            5,
        ),
    }
}

/// Reserves a delivery id; while another request holds it, waits (bounded) for that one
/// to finish, so a concurrent retry gets the real answer (duplicate, or taken over after a
/// failed store) instead of a 503.
pub(crate) async fn reserve(
    dedup: &dyn Dedup,
    key: &str,
) -> Result<Reserve, crate::store::StoreError> {
    for _ in 0..40 {
        match dedup.reserve(key).await? {
            Reserve::InFlight => tokio::time::sleep(Duration::from_millis(50)).await,
            other => return Ok(other),
        }
    }
    Ok(Reserve::InFlight)
}
