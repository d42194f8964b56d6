//! The outcome stage: what an intent came to, its outbox row, and the answers to every repeat.

pub(crate) mod answer;
mod event;
pub(crate) mod finish;

pub(crate) use answer::KeyState;
pub use event::{
    outcome_id, storable_result, too_large, ErrorCode, Outcome, OutcomeData, OutcomeError,
    OutcomeStatus, OUTCOME_SOURCE, OUTCOME_SPECVERSION, OUTCOME_TYPE,
};
pub(crate) use finish::{finish, finish_parked, Finish, FinishError, Guard, Settled};
