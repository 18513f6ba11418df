//! The `redis-stream` target: XADD each event (structured JSON in field `event`, plus its
//! `id`, `source` and `type` for consumers that filter) to a stream, trimmed with
//! `MAXLEN ~ n`. A batch goes as one pipeline: one round trip.

use async_trait::async_trait;
use redis::aio::ConnectionManager;
use tokio::sync::OnceCell;

use crate::targets::config::RedisStreamConfig;
use crate::targets::policy::TargetPolicy;
use crate::targets::target::{Envelope, Target, TargetError};

pub struct RedisStreamTarget {
    config: RedisStreamConfig,
    client: redis::Client,
    connection: OnceCell<ConnectionManager>,
}

impl RedisStreamTarget {
    pub fn new(
        config: &RedisStreamConfig,
        policy: &TargetPolicy,
    ) -> Result<RedisStreamTarget, TargetError> {
        config.check().map_err(TargetError::fatal)?;
        let url = crate::targets::policy::redis_url(&config.url, &policy.secret_env_prefix)?;
        // The client's error may quote the URL, password included.
        let client = redis::Client::open(url.as_str()).map_err(|e| {
            TargetError::fatal(
                e.to_string()
                    .replace(url.as_str(), &crate::values::redact_url(&url)),
            )
        })?;
        Ok(RedisStreamTarget {
            config: config.clone(),
            client,
            connection: OnceCell::new(),
        })
    }
}

#[async_trait]
impl Target for RedisStreamTarget {
    async fn deliver(&self, events: &[Envelope]) -> Result<(), TargetError> {
        let mut connection = self
            .connection
            .get_or_try_init(|| ConnectionManager::new(self.client.clone()))
            .await
            .map_err(|e| TargetError::retryable(format!("cannot connect to Redis: {e}")))?
            .clone();
        let mut pipe = redis::pipe();
        for envelope in events {
            let event = envelope.decoded()?;
            let mut fields: Vec<(&str, Vec<u8>)> = vec![
                (
                    "id",
                    cloudevents::AttributesReader::id(event.as_ref())
                        .as_bytes()
                        .to_vec(),
                ),
                (
                    "source",
                    cloudevents::AttributesReader::source(event.as_ref())
                        .to_string()
                        .into_bytes(),
                ),
                (
                    "type",
                    cloudevents::AttributesReader::ty(event.as_ref())
                        .as_bytes()
                        .to_vec(),
                ),
            ];
            match &envelope.body {
                Some(transformed) => fields.push(("body", transformed.bytes.to_vec())),
                None => fields.push(("event", envelope.raw.to_vec())),
            }
            pipe.xadd_maxlen(
                &self.config.stream,
                redis::streams::StreamMaxlen::Approx(self.config.maxlen),
                "*",
                &fields,
            )
            .ignore();
        }
        pipe.query_async::<()>(&mut connection).await.map_err(|e| {
            TargetError::retryable(format!("XADD to `{}` failed: {e}", self.config.stream))
        })
    }

    fn describe(&self) -> String {
        format!("redis-stream {}", self.config.stream)
    }
}
