//! Group commit: many callers' requests, one transaction. Each caller awaits its own answer;
//! a few workers keep several groups in flight so commits overlap.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Mutex};

/// A request's failure, shared by every request of the group it was committed in.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct GroupError {
    /// Retrying may succeed (the database was unreachable, a deadlock).
    pub transient: bool,
    pub message: String,
}

impl From<&crate::db::DbError> for GroupError {
    fn from(e: &crate::db::DbError) -> Self {
        GroupError {
            transient: e.is_transient(),
            message: e.to_string(),
        }
    }
}

type Item<T, R> = (T, oneshot::Sender<R>);

pub struct GroupCommit<T, R> {
    tx: mpsc::Sender<Item<T, R>>,
}

impl<T: Send + 'static, R: Send + 'static> GroupCommit<T, R> {
    /// Starts `workers` tasks, each taking up to `max` waiting requests at a time and handing
    /// them to `run`, which answers each in order. A group forms from whatever is waiting: no
    /// request waits for others to arrive.
    pub fn spawn<F, Fut>(max: usize, workers: usize, run: F) -> Self
    where
        F: Fn(Vec<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<R>> + Send,
    {
        let (tx, rx) = mpsc::channel::<Item<T, R>>(max * workers * 2);
        let rx = Arc::new(Mutex::new(rx));
        let run = Arc::new(run);
        for _ in 0..workers {
            let (rx, run) = (rx.clone(), run.clone());
            tokio::spawn(async move {
                loop {
                    let mut items = Vec::with_capacity(max);
                    {
                        let mut rx = rx.lock().await;
                        match rx.recv().await {
                            Some(item) => items.push(item),
                            None => return,
                        }
                        while items.len() < max {
                            match rx.try_recv() {
                                Ok(item) => items.push(item),
                                Err(_) => break,
                            }
                        }
                    }
                    let (requests, replies): (Vec<T>, Vec<oneshot::Sender<R>>) =
                        items.into_iter().unzip();
                    let answers = run(requests).await;
                    debug_assert_eq!(answers.len(), replies.len(), "one answer per request");
                    for (reply, answer) in replies.into_iter().zip(answers) {
                        let _ = reply.send(answer);
                    }
                }
            });
        }
        GroupCommit { tx }
    }

    /// Sends one request and waits for its answer; `None` once the workers are gone.
    pub async fn call(&self, request: T) -> Option<R> {
        let (tx, rx) = oneshot::channel();
        self.tx.send((request, tx)).await.ok()?;
        rx.await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_caller_gets_its_own_answer_and_groups_form() {
        let sizes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = sizes.clone();
        let b = Arc::new(GroupCommit::spawn(10, 1, move |xs: Vec<u32>| {
            seen.lock().unwrap().push(xs.len());
            async move {
                tokio::task::yield_now().await;
                xs.into_iter().map(|x| x * 2).collect()
            }
        }));
        let calls = (0..100).map(|i| {
            let b = b.clone();
            async move { (i, b.call(i).await.unwrap()) }
        });
        for (i, doubled) in futures::future::join_all(calls).await {
            assert_eq!(doubled, i * 2);
        }
        let sizes = sizes.lock().unwrap();
        assert_eq!(sizes.iter().sum::<usize>(), 100);
        assert!(sizes.iter().all(|n| *n <= 10));
        assert!(sizes.len() < 100, "requests were grouped: {sizes:?}");
    }
}
