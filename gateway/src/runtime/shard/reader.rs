//! The shard's reader: reads each record once and hands it to the lanes that take it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::runtime::plan::shard_task_id;

use crate::runtime::shard::lane::*;
use crate::runtime::shard::shared::Shared;
use crate::store::cluster::State;
use crate::store::{Seq, ShardReader, StoreError};

/// The shard reader: reads the log from the shared position and hands records out.
pub(super) struct ReaderLoop {
    pub(super) shared: Arc<Shared>,
    pub(super) log: Arc<dyn crate::store::BusLog>,
    pub(super) reader: Option<Box<dyn ShardReader>>,
    pub(super) read_wait: Duration,
    pub(super) batch: usize,
    pub(super) backoff: Duration,
}

impl ReaderLoop {
    pub(super) async fn run(&mut self) {
        let mut idle_check = tokio::time::Instant::now();
        loop {
            if self.shared.stopping() {
                return;
            }
            if self.shared.queued.load(Ordering::Relaxed) >= SHARD_QUEUE_BYTES {
                self.shared.make_room().await;
                continue;
            }
            let cursor = lock(&self.shared.dispatch).cursor;
            if self.shared.reopen.swap(false, Ordering::AcqRel) {
                self.reader = None;
            }
            if self.reader.is_none() {
                match self.log.reader(self.shared.shard, cursor).await {
                    Ok(mut r) => {
                        r.set_max_bytes(self.shared.delivery.batch_bytes);
                        self.reader = Some(r);
                    }
                    Err(e) => {
                        self.failed(e).await;
                        continue;
                    }
                }
            }
            let Some(reader) = self.reader.as_mut() else {
                continue;
            };
            match reader.read_wait(self.batch, self.read_wait).await {
                Ok(records) if records.is_empty() => {
                    // Idle: now and then check the log still reaches the reader's position
                    // (a store that rolled back underneath never will, and the events
                    // appended since would get sequence numbers it is already past).
                    if idle_check.elapsed() >= ROLLBACK_CHECK {
                        idle_check = tokio::time::Instant::now();
                        if let Ok(end) = self.log.end(self.shared.shard).await {
                            if end < cursor {
                                self.rolled_back(end, cursor).await;
                            }
                        }
                    }
                }
                Ok(records) => {
                    idle_check = tokio::time::Instant::now();
                    self.backoff = self.shared.delivery.initial_backoff;
                    if let Some(first) = records.first() {
                        if first.seq > cursor {
                            // Trimmed past the reader's position (released by a slower
                            // setting or by hand): continue at what is there.
                            tracing::warn!(
                                shard = self.shared.shard,
                                expected = cursor,
                                found = first.seq,
                                "records are missing from the shard"
                            );
                        }
                    }
                    let full = records.len() >= self.batch;
                    self.shared.dispatch(records);
                    if !full {
                        // Under load, let the appenders add to the shard before the next
                        // read, rather than wake for every record: one read then takes what
                        // many requests appended. Idle, this returns at once.
                        tokio::task::yield_now().await;
                    }
                }
                Err(e) => {
                    self.reader = None;
                    self.failed(e).await;
                }
            }
        }
    }

    /// The log ends at `end`, below the reader's position: the store rolled back (Redis
    /// restored from an older snapshot or failed over to a lagging replica). Goes back to
    /// the first event accepted since shortly before the last one the reader saw, so the
    /// events appended since the rollback are delivered, not skipped (some that were
    /// delivered before may be delivered again).
    pub(super) async fn rolled_back(&mut self, end: Seq, cursor: Seq) {
        let shard = self.shared.shard;
        let seen = self.shared.last_accepted.load(Ordering::Relaxed);
        let start = self.log.start(shard).await.unwrap_or(0);
        let boundary = if seen == 0 {
            start
        } else {
            let since = seen.saturating_sub(ROLLBACK_MARGIN_MS);
            match crate::store::search::first_after(self.log.as_ref(), shard, start, end, since)
                .await
            {
                Ok(boundary) => boundary,
                Err(e) => {
                    tracing::warn!(shard, error = %e, "cannot search the rolled-back log; checking again shortly");
                    return;
                }
            }
        };
        let bus = lock(&self.shared.dispatch).bus.name.clone();
        tracing::error!(
            bus = %bus,
            shard,
            log_end = end,
            position = cursor,
            from = boundary,
            "the log now ends before the reader's position: the store rolled back and lost the events from `log_end` up to `position`; delivering again from `from`, the first event accepted since shortly before the last one read, so the events appended since are not skipped"
        );
        self.shared.rewind(boundary);
        self.reader = None;
    }

    pub(super) async fn failed(&mut self, e: StoreError) {
        let bus = lock(&self.shared.dispatch).bus.name.clone();
        tracing::error!(bus = %bus, shard = self.shared.shard, error = %e, "reading the shard failed; retrying");
        if self.shared.leased() {
            self.shared
                .cluster
                .report(
                    &shard_task_id(&bus, self.shared.shard),
                    State::Failed,
                    Some(e.to_string()),
                )
                .await;
        }
        let wait = self.backoff;
        self.backoff = (self.backoff * 2).min(self.shared.delivery.max_backoff);
        tokio::time::sleep(wait).await;
    }
}
