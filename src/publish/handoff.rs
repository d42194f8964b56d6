//! Outbox rows a finish committed, handed to the publishers in memory: they go out without a
//! NOTIFY, without the publisher's read of the queue and the outbox, and without waiting for a
//! poll. The queue (`outbox_pending`) stays the record of what is unpublished: a handed row is
//! sent only once its publisher has taken it out of the queue, under a lock another relay's
//! round skips, so a row goes out once whichever relay or path meets it first. A row that is
//! not handed (the relay stopped, the hand-off was full) waits in the queue for a poll.

use std::sync::Mutex;

use tokio::sync::Notify;

use crate::publish::outbox::OutboxRow;

/// Rows waiting in memory at most; past this a finish wakes the poll instead, which reads the
/// same rows from the queue (the publisher is behind, so a round of the poll is full anyway).
const HANDED_MAX: usize = 4_000;

#[derive(Default)]
pub struct Handoff {
    rows: Mutex<Vec<OutboxRow>>,
    /// Rows were handed.
    handed: Notify,
    /// The publishers should read the queue: rows were committed that are not handed.
    poll: Notify,
}

impl Handoff {
    pub fn new() -> Self {
        Self::default()
    }

    /// Hands rows the caller committed to the queue (each row's id is its queue entry).
    pub(crate) fn hand(&self, rows: Vec<OutboxRow>) {
        if rows.is_empty() {
            return;
        }
        {
            let mut waiting = self.rows.lock().expect("hand-off lock");
            if waiting.len() + rows.len() <= HANDED_MAX {
                waiting.extend(rows);
                drop(waiting);
                self.handed.notify_one();
                return;
            }
        }
        self.poll.notify_one();
    }

    /// Asks the publishers to read the queue (a NOTIFY arrived, or rows were not handed).
    pub fn wake_poll(&self) {
        self.poll.notify_one();
    }

    /// Takes up to `max` handed rows, oldest first.
    pub(crate) fn take(&self, max: usize) -> Vec<OutboxRow> {
        let mut waiting = self.rows.lock().expect("hand-off lock");
        let n = waiting.len().min(max);
        waiting.drain(..n).collect()
    }

    /// Whether rows wait to be taken.
    pub(crate) fn is_empty(&self) -> bool {
        self.rows.lock().expect("hand-off lock").is_empty()
    }

    /// Completes once rows are handed (at once if some were handed since the last wait).
    pub(crate) async fn handed(&self) {
        self.handed.notified().await
    }

    /// Completes once a poll is asked for.
    pub(crate) async fn poll_asked(&self) {
        self.poll.notified().await
    }
}
