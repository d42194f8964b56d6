//! The outcome stage: what an intent came to, its outbox row, and the answers to every repeat.

pub mod answer;
pub(crate) mod finish;

pub use answer::KeyState;
pub use finish::{finish, finish_many, Finish, FinishError, Guard, Settled};
