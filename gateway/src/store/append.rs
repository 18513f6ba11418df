//! The one way an event becomes a record of a bus, whoever appends it: ingress (CloudEvents
//! and webhook sources), the bus and function targets, dead letters and sources.
//! `prepare` holds the stored form to a size limit and to what delivery can read back, and
//! places it on its shard; `append` writes prepared records, one append per shard, each
//! shard's records in their order.

use std::collections::BTreeMap;

use bytes::Bytes;
use cloudevents::Event;

use crate::event::{check_stored, partition_key, shard_of, EventError};
use crate::store::{BusLog, ShardAppend, StoreError};

/// An event ready to append: its shard and its stored bytes.
pub type Prepared = (u32, Bytes);

/// Prepares the stored form `stored` of `event` for a bus of `shards` shards: at most
/// `max_bytes` (else an error naming `limit`), readable by delivery (checked unless the
/// parser already read it back as delivery does, `reads_back`), on the shard of the
/// event's partition key.
pub fn prepare(
    event: &Event,
    stored: Vec<u8>,
    reads_back: bool,
    shards: u32,
    max_bytes: usize,
    limit: &str,
) -> Result<Prepared, EventError> {
    if stored.len() > max_bytes {
        return Err(EventError::too_large(
            limit,
            format!(
                "the event is {} bytes; at most {max_bytes} are accepted",
                stored.len()
            ),
        ));
    }
    // Accept exactly what delivery can read: anything else would stall its shard.
    if !reads_back {
        check_stored(&stored)?;
    }
    let shard = shard_of(&partition_key(event), shards);
    // The store's tail cache keeps these bytes and counts their length: no spare capacity
    // from the encoder's growth may ride along.
    let mut stored = stored;
    stored.shrink_to_fit();
    Ok((shard, Bytes::from(stored)))
}

/// Appends the prepared records (`None`: an entry that is not to be stored) in one append
/// per shard; the result of each entry, `None` where there was no record.
pub async fn append(
    log: &dyn BusLog,
    records: &[Option<Prepared>],
) -> Vec<Option<Result<(), StoreError>>> {
    let mut by_shard: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, record) in records.iter().enumerate() {
        if let Some((shard, _)) = record {
            by_shard.entry(*shard).or_default().push(i);
        }
    }
    let groups: Vec<(u32, Vec<usize>)> = by_shard.into_iter().collect();
    let appends = groups
        .iter()
        .map(|(shard, indexes)| ShardAppend {
            shard: *shard,
            records: indexes
                .iter()
                .filter_map(|i| records[*i].as_ref().map(|(_, bytes)| bytes.clone()))
                .collect(),
        })
        .collect();
    let results = log.append(appends).await;
    let mut stored = vec![None; records.len()];
    for ((_, indexes), result) in groups.iter().zip(results) {
        for i in indexes {
            stored[*i] = Some(result.as_ref().map(|_| ()).map_err(Clone::clone));
        }
    }
    stored
}
