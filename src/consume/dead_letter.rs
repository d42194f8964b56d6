//! Dead letters: a message idem cannot record goes to the dead-letter topic with its reason,
//! and its offset never moves past it unless that write succeeded.

use std::time::Duration;

use rdkafka::message::{BorrowedMessage, Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use rdkafka::Message;
use tokio_util::sync::CancellationToken;

use super::*;

/// Tries to write one dead letter before the batch is given up and read again (about 30 s
/// with the backoff, each try bounded by the producer's own timeout).
const DEAD_LETTER_TRIES: u32 = 8;
/// The reason's detail is cut to this in the dead letter's header.
const MAX_DETAIL_BYTES: usize = 4096;

/// A dead letter that could not be written; the message's offset must not move past it.
pub(super) struct DeadLetterFailed;

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Dead letters carry the original bytes up to this size (the producer's limit is 1 MB).
const MAX_DEAD_LETTER_BYTES: usize = 900 * 1024;

impl Consume {
    /// Copies the original bytes and headers to the dead-letter topic with the reason. Retried
    /// with backoff up to [`DEAD_LETTER_TRIES`] times; `Err` when it could not be written (or
    /// shutdown came first): the offset must then not move past the message.
    pub(super) async fn dead_letter(
        &self,
        m: &BorrowedMessage<'_>,
        reason: &str,
        detail: &str,
        shutdown: &CancellationToken,
    ) -> Result<(), DeadLetterFailed> {
        let partition = m.partition().to_string();
        let offset = m.offset().to_string();
        // The size budget counts headers too: the original ones go along only while they fit.
        let original = headers_of(m);
        let original_bytes: usize = original.iter().map(|(k, v)| k.len() + v.len()).sum();
        let detail = truncate(detail, MAX_DETAIL_BYTES);
        let keep_original = original_bytes <= MAX_DEAD_LETTER_BYTES / 4;
        let mut headers = OwnedHeaders::new();
        if keep_original {
            for (key, value) in &original {
                headers = headers.insert(Header {
                    key,
                    value: Some(*value),
                });
            }
        }
        let headers = headers
            .insert(Header {
                key: "idem-dlq-reason",
                value: Some(reason),
            })
            .insert(Header {
                key: "idem-dlq-detail",
                value: Some(detail),
            })
            .insert(Header {
                key: "idem-source-topic",
                value: Some(m.topic()),
            })
            .insert(Header {
                key: "idem-source-partition",
                value: Some(&partition),
            })
            .insert(Header {
                key: "idem-source-offset",
                value: Some(&offset),
            });
        let headers = if keep_original {
            headers
        } else {
            headers.insert(Header {
                key: "idem-dlq-headers-dropped",
                value: Some(&original_bytes.to_string()),
            })
        };
        let header_bytes = if keep_original { original_bytes } else { 0 } + detail.len() + 512;
        let budget = MAX_DEAD_LETTER_BYTES.saturating_sub(header_bytes);
        // A payload the producer cannot send whole is cut, and the cut is said in a header.
        let payload = m.payload().unwrap_or_default();
        let (payload, headers) = if payload.len() > budget {
            let h = headers.insert(Header {
                key: "idem-dlq-truncated",
                value: Some(&payload.len().to_string()),
            });
            (&payload[..budget], h)
        } else {
            (payload, headers)
        };
        let mut backoff = Backoff::waiting(Duration::from_millis(100));
        let mut tries = 0;
        loop {
            let mut record: FutureRecord<'_, [u8], [u8]> =
                FutureRecord::to(&self.config.kafka.dlq_topic)
                    .headers(headers.clone())
                    .payload(payload);
            if let Some(k) = m.key() {
                record = record.key(k);
            }
            tries += 1;
            let (generation, producer) = self.producer.get();
            let sent = tokio::select! {
                _ = shutdown.cancelled() => return Err(DeadLetterFailed),
                sent = producer.send(record, Duration::from_secs(30)) => sent,
            };
            if sent.is_err() {
                self.producer.heal(generation, &self.metrics);
            }
            match sent {
                Ok(_) => break,
                Err((e, _)) if tries >= DEAD_LETTER_TRIES => {
                    self.metrics.dead_letter_failed();
                    tracing::error!(error = %e, tries, reason, topic = m.topic(), partition = m.partition(), offset = m.offset(), "cannot write to the dead-letter topic; the batch is read again later");
                    return Err(DeadLetterFailed);
                }
                Err((e, _)) => {
                    tracing::warn!(error = %e, tries, "cannot write to the dead-letter topic; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Err(DeadLetterFailed),
                        _ = tokio::time::sleep(backoff.after_failure()) => {}
                    }
                }
            }
        }
        self.metrics.dead_letter(reason);
        tracing::warn!(
            reason,
            detail,
            topic = m.topic(),
            partition = m.partition(),
            offset = m.offset(),
            "action dead-lettered"
        );
        Ok(())
    }
}
