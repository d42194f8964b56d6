//! Outbox rows a finish committed, handed to the publishers in memory: they go out without a
//! NOTIFY, without the publisher's read of the queue and the outbox, and without waiting for a
//! poll. The queue (`outbox_pending`) stays the record of what is unpublished: a handed row is
//! sent only once its publisher has taken it out of the queue, under a lock another relay's
//! round skips, so a row goes out once whichever relay or path meets it first. A row that is
//! not handed (the relay stopped, the hand-off was full) waits in the queue for a poll.

use std::sync::atomic::{AtomicBool, Ordering};
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
    /// A round left rows queued behind a row of their key that another round held: the next
    /// round to commit asks for a poll, which may send them now.
    held_back: AtomicBool,
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

    /// A round left rows queued behind an earlier row of their key that another round holds.
    pub(crate) fn held_back(&self) {
        self.held_back.store(true, Ordering::Release);
    }

    /// A round that took rows committed (its rows are published or back in the queue): if a
    /// round left rows behind meanwhile, a poll may send them now. Otherwise they wait for the
    /// next poll: a round of another relay does not tell this one it committed.
    pub(crate) fn round_committed(&self) {
        if self.held_back.swap(false, Ordering::AcqRel) {
            self.wake_poll();
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[test]
    fn a_round_committing_after_rows_were_held_back_asks_for_one_poll() {
        let handoff = Handoff::new();
        handoff.round_committed();
        assert!(
            handoff.poll_asked().now_or_never().is_none(),
            "nothing was held back"
        );
        handoff.held_back();
        handoff.held_back();
        handoff.round_committed();
        assert!(handoff.poll_asked().now_or_never().is_some());
        handoff.round_committed();
        assert!(
            handoff.poll_asked().now_or_never().is_none(),
            "one poll for what was held back before a commit"
        );
    }
}
