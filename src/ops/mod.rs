//! What people do with keys, from the CLI or the admin API (both call the same functions):
//! `explain` (every delivery, attempt, decision and outcome of one key, in one answer) and
//! `resolve` (settle a key parked `unknown`, recording who and why).

use crate::db::DbError;

pub mod admin;
mod console;
mod explain;
mod resolve;
mod serve;
mod tools;

pub use explain::{explain, render};
pub use resolve::{resolve, Resolution};
pub use serve::{serve, Limits};
pub use tools::{catalogue, render as render_catalogue};

#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error("no intent with key {0:?}")]
    NotFound(String),
    #[error("key {key:?} is {status}, not unknown: only parked keys are resolved")]
    NotParked { key: String, status: String },
    #[error("key {key:?} now stands for request {actual}, not {expected}: look at it again before deciding")]
    FingerprintMismatch {
        key: String,
        expected: String,
        actual: String,
    },
    #[error(transparent)]
    Db(#[from] DbError),
}

crate::db::from_postgres!(InspectError);
