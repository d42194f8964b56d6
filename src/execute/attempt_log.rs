//! The attempt log decides: what a key's next claim does, derived from its durable attempt
//! history alone.
//!
//! Every call and verification of a key is a row in `attempts`, opened before it starts and
//! closed with what it told. A relay can die anywhere between two rows, so nothing else (which
//! attempt happens to be open, a flag set by the relay that died) is trusted. [`next_step`] is
//! the one rule, a pure function over that history, used by recovery before it hands a key to
//! the next claim.

use std::time::Duration;

/// One row of the attempt log, as recovery reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct Past {
    pub kind: Kind,
    /// How it ended; `None` while open (its relay died during it, or it is running now).
    pub ended: Option<Ended>,
    /// How long ago it started, by the database's clock.
    pub age: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Call,
    Verify,
}

/// The classification written when an attempt closed (`attempts.classification`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ended {
    // calls
    Succeeded,
    Failed,
    /// The downstream said nothing was processed (429 and friends).
    Retry,
    /// The request never left (connection refused), or the claim was given back unstarted.
    NotSent,
    /// Sent, and the effect may have happened.
    Ambiguous,
    // verifications
    Done,
    NotDone,
    Inconclusive,
    /// Its relay died during it (written by recovery).
    Abandoned,
}

impl Ended {
    pub fn parse(s: &str) -> Option<Ended> {
        Some(match s {
            "succeeded" => Ended::Succeeded,
            "failed" => Ended::Failed,
            "retry" => Ended::Retry,
            "not_sent" => Ended::NotSent,
            "ambiguous" => Ended::Ambiguous,
            "done" => Ended::Done,
            "not_done" => Ended::NotDone,
            "inconclusive" => Ended::Inconclusive,
            "abandoned" => Ended::Abandoned,
            _ => return None,
        })
    }
}

impl Kind {
    pub fn parse(s: &str) -> Kind {
        if s == "verify" {
            Kind::Verify
        } else {
            Kind::Call
        }
    }
}

/// What the next claim of a key does.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Nothing in the history may have happened: call.
    Call,
    /// A call may have happened and no later verification concluded: look downstream first,
    /// and never call before it answers "not done" after `call_age` has passed the tool's
    /// timeout.
    Verify {
        /// How long ago the last call that may have happened started.
        call_age: Duration,
    },
}

/// What the history says of the key.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub next: Next,
    /// Calls that count against the retry budget: every call that was tried, whatever it told,
    /// except those that certainly never left this relay (`not_sent`).
    pub calls: i32,
}

/// The rule. Only a dangerous http tool's effect can be doubled by a second call (an idempotent
/// tool may repeat by definition; a sql tool's effect rolls back with its transaction), so for
/// every other tool the next step is always a call.
///
/// For a dangerous http tool, the history is read in order, tracking whether an effect may have
/// happened: a call that is open, `ambiguous`, `abandoned` or `succeeded` may have (a success
/// recorded on a key that is not terminal is treated as "happened", and verify returns it); a
/// verification that answered `not_done` concludes it did not (verifications record `not_done`
/// only once the call's deadline had passed; a person's `resolve --as retry` is recorded as one);
/// `done` says it did. Inconclusive, open or abandoned verifications conclude nothing.
pub fn next_step(history: &[Past], dangerous_http: bool) -> Verdict {
    let calls = history
        .iter()
        .filter(|p| p.kind == Kind::Call && p.ended != Some(Ended::NotSent))
        .count() as i32;
    if !dangerous_http {
        return Verdict {
            next: Next::Call,
            calls,
        };
    }
    // The age of the last call that may have happened, while nothing has concluded otherwise.
    let mut maybe: Option<Duration> = None;
    for p in history {
        match (p.kind, p.ended) {
            (
                Kind::Call,
                None | Some(Ended::Ambiguous | Ended::Abandoned | Ended::Succeeded | Ended::Done),
            ) => {
                maybe = Some(p.age);
            }
            // The effect certainly did not happen by this call; an earlier one may still have.
            (Kind::Call, Some(Ended::Failed | Ended::Retry | Ended::NotSent | Ended::NotDone)) => {}
            (Kind::Call, Some(Ended::Inconclusive)) => maybe = Some(p.age),
            (Kind::Verify, Some(Ended::NotDone)) => maybe = None,
            (Kind::Verify, Some(Ended::Done | Ended::Succeeded)) => {
                // Done: the effect happened; the next claim verifies again to read its result.
                maybe = Some(maybe.unwrap_or(p.age));
            }
            (Kind::Verify, _) => {}
        }
    }
    Verdict {
        next: match maybe {
            Some(call_age) => Next::Verify { call_age },
            None => Next::Call,
        },
        calls,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(kind: Kind, ended: Option<Ended>, age_s: u64) -> Past {
        Past {
            kind,
            ended,
            age: Duration::from_secs(age_s),
        }
    }
    use Ended::*;
    use Kind::*;

    fn next(h: &[Past]) -> Next {
        next_step(h, true).next
    }

    fn verify(age_s: u64) -> Next {
        Next::Verify {
            call_age: Duration::from_secs(age_s),
        }
    }

    #[test]
    fn a_key_with_no_history_is_called() {
        assert_eq!(
            next_step(&[], true),
            Verdict {
                next: Next::Call,
                calls: 0
            }
        );
    }

    #[test]
    fn a_call_that_may_have_happened_is_verified_first() {
        for ended in [None, Some(Ambiguous), Some(Abandoned), Some(Succeeded)] {
            assert_eq!(next(&[at(Call, ended, 9)]), verify(9), "{ended:?}");
        }
    }

    #[test]
    fn a_call_that_certainly_did_not_happen_is_called_again() {
        for ended in [Some(NotSent), Some(Retry), Some(Failed)] {
            assert_eq!(next(&[at(Call, ended, 9)]), Next::Call, "{ended:?}");
        }
    }

    /// The window of issue 12: the call ended ambiguous, a verification was opened, and the
    /// relay died (open), or it was abandoned, or it answered inconclusive.
    #[test]
    fn an_unconcluded_verification_after_an_ambiguous_call_verifies_again() {
        for ended in [None, Some(Abandoned), Some(Inconclusive)] {
            let h = [at(Call, Some(Ambiguous), 12), at(Verify, ended, 11)];
            assert_eq!(next(&h), verify(12), "{ended:?}");
        }
        let h = [
            at(Call, Some(Ambiguous), 20),
            at(Verify, Some(Inconclusive), 19),
            at(Verify, Some(Inconclusive), 18),
            at(Verify, Some(Abandoned), 17),
        ];
        assert_eq!(next(&h), verify(20));
    }

    #[test]
    fn a_verification_that_concluded_not_done_allows_a_call() {
        let h = [at(Call, Some(Ambiguous), 5), at(Verify, Some(NotDone), 4)];
        assert_eq!(next(&h), Next::Call);
        // …and the call after it may have happened in turn.
        let h = [
            at(Call, Some(Ambiguous), 5),
            at(Verify, Some(NotDone), 4),
            at(Call, None, 3),
        ];
        assert_eq!(next(&h), verify(3));
        let h = [
            at(Call, Some(Ambiguous), 5),
            at(Verify, Some(NotDone), 4),
            at(Call, Some(Retry), 3),
        ];
        assert_eq!(next(&h), Next::Call);
    }

    #[test]
    fn a_verification_that_found_the_effect_is_verified_again_for_its_result() {
        let h = [at(Call, Some(Abandoned), 5), at(Verify, Some(Done), 4)];
        assert_eq!(next(&h), verify(5));
    }

    #[test]
    fn a_later_not_sent_call_does_not_hide_an_earlier_ambiguous_one() {
        let h = [at(Call, Some(Ambiguous), 8), at(Call, Some(NotSent), 2)];
        assert_eq!(next(&h), verify(8));
    }

    #[test]
    fn the_last_maybe_call_sets_the_deadline() {
        let h = [
            at(Call, Some(Ambiguous), 30),
            at(Verify, Some(Inconclusive), 29),
            at(Call, Some(Abandoned), 2),
        ];
        assert_eq!(next(&h), verify(2));
    }

    #[test]
    fn every_call_tried_counts_against_the_budget_except_those_never_sent() {
        let h = [
            at(Call, Some(Ambiguous), 9),
            at(Verify, Some(NotDone), 8),
            at(Call, Some(Retry), 7),
            at(Call, Some(NotSent), 6),
            at(Call, Some(Abandoned), 5),
            at(Verify, None, 4),
        ];
        assert_eq!(next_step(&h, true).calls, 3);
    }

    #[test]
    fn other_tools_are_always_called() {
        let h = [at(Call, Some(Ambiguous), 9), at(Verify, None, 8)];
        assert_eq!(
            next_step(&h, false),
            Verdict {
                next: Next::Call,
                calls: 1
            }
        );
    }
}
