//! A model of the intent / attempt / lease / verify protocol, checked exhaustively with
//! stateright. The rule recovery follows is the real one: [`idem::execute::attempt_log::next_step`].
//!
//! What it covers: one dangerous key, two relays, a downstream that does not dedupe. Any relay
//! may crash at any step (its in-flight request may still reach the downstream afterwards); a
//! lease may run out at any moment (a crash, or a pause past the lease); the downstream applies
//! or loses each request, and answers or not; a verification answers done, not done or
//! inconclusive. The database steps are the relay's statements, each atomic as in Postgres:
//! claim (opens the first attempt), fence-and-send, end an attempt (never over an end already
//! written), begin the next attempt (fenced by epoch and lease), finish (fenced by epoch),
//! recovery (abandons open attempts, applies the rule, bumps the epoch).
//!
//! What it assumes: (1) a request is not applied by the downstream after its deadline (start
//! plus the tool's timeout): "not done" is conclusive only when no request of the key may still
//! be in flight, which the relay enforces by waiting for the deadline; (2) no relay pauses
//! between its fence (or the attempt row it opens) and the send for longer than the lease: the
//! two are one step here; (3) verification does not lie.
//!
//! Properties: the effect happens at most once; a key finished `succeeded` has its effect; a
//! finished key is reachable (the model is not vacuous). A second check runs the rule recovery
//! used before issue 12 (verify only when a *call* attempt was open) and requires the checker
//! to find the double effect, so the model is known to catch that window.

use idem::execute::attempt_log::{next_step, Ended, Kind, Next, Past};
use stateright::{Checker, Model, Property};
use std::time::Duration;

const RELAYS: usize = 2;
const MAX_CRASHES: u8 = 2;
/// Attempts per key explored: 7 in CI (a few seconds); `IDEM_MODEL_ATTEMPTS=8` explores
/// about 9 million states in a minute.
fn max_history() -> usize {
    std::env::var("IDEM_MODEL_ATTEMPTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7)
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Request {
    None,
    /// Sent; the downstream has not processed it yet.
    InFlight,
    Applied,
    Lost,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Pc {
    Idle,
    /// Claimed at `epoch`; its open attempt (`seq`, an index into the history) is a call (to
    /// fence and send) or a verification.
    Claimed {
        epoch: u8,
        verify: bool,
        seq: usize,
    },
    /// Request sent under `epoch`, waiting for the answer.
    Waiting {
        epoch: u8,
        seq: usize,
    },
    /// The call ended ambiguous (written); verifying under `epoch`.
    Verifying {
        epoch: u8,
        seq: usize,
    },
    /// Knows the effect happened; to finish under `epoch`.
    Finishing {
        epoch: u8,
        seq: usize,
    },
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    status: Status,
    epoch: u8,
    lease_valid: bool,
    needs_verify: bool,
    history: Vec<(Kind, Option<Ended>)>,
    effects: u8,
    relays: [Pc; RELAYS],
    /// Each relay's last request to the downstream (it outlives a crash of its relay).
    requests: [Request; RELAYS],
    crashes: u8,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Status {
    Pending,
    Running,
    Succeeded,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Claim(usize),
    FenceAndSend(usize),
    Apply(usize),
    Lose(usize),
    /// The answer reaches the relay: a success if applied and answered, else ambiguous (lost
    /// answer, 5xx, timeout — the relay times out only once the request was processed or lost:
    /// assumption 1).
    Answer(usize, bool),
    Verify(usize, VerifyAnswer),
    Finish(usize),
    Crash(usize),
    LeaseRunsOut,
    Recover,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum VerifyAnswer {
    Done,
    NotDone,
    Inconclusive,
}

#[derive(Clone, Copy)]
enum Rule {
    /// `idem::execute::attempt_log::next_step`.
    AttemptLog,
    /// Before issue 12: verify only when a call attempt was still open at recovery.
    OpenCallOnly,
}

struct Protocol {
    rule: Rule,
    max_history: usize,
}

impl State {
    /// `END_ATTEMPT` of the relay's own attempt: never over an end already written (recovery's
    /// `abandoned`).
    fn end_attempt(&mut self, seq: usize, ended: Ended) {
        if self.history[seq].1.is_none() {
            self.history[seq].1 = Some(ended);
        }
    }

    /// `BEGIN_ATTEMPT`: fenced by epoch and lease; the new attempt's seq.
    fn begin(&mut self, epoch: u8, kind: Kind) -> Option<usize> {
        if self.epoch != epoch || !self.lease_valid || self.status != Status::Running {
            return None;
        }
        self.history.push((kind, None));
        Some(self.history.len() - 1)
    }

    fn may_be_in_flight(&self) -> bool {
        self.requests.contains(&Request::InFlight)
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            status: Status::Pending,
            epoch: 0,
            lease_valid: false,
            needs_verify: false,
            history: Vec::new(),
            effects: 0,
            relays: [Pc::Idle; RELAYS],
            requests: [Request::None; RELAYS],
            crashes: 0,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        for r in 0..RELAYS {
            match s.relays[r] {
                Pc::Idle if s.status == Status::Pending => actions.push(Action::Claim(r)),
                Pc::Idle => {}
                Pc::Claimed { verify: false, .. } => actions.push(Action::FenceAndSend(r)),
                Pc::Claimed { verify: true, .. } | Pc::Verifying { .. } => {
                    for a in [
                        VerifyAnswer::Done,
                        VerifyAnswer::NotDone,
                        VerifyAnswer::Inconclusive,
                    ] {
                        actions.push(Action::Verify(r, a));
                    }
                }
                Pc::Waiting { .. } => match s.requests[r] {
                    Request::Applied => {
                        actions.push(Action::Answer(r, true));
                        actions.push(Action::Answer(r, false));
                    }
                    Request::Lost => actions.push(Action::Answer(r, false)),
                    Request::InFlight | Request::None => {}
                },
                Pc::Finishing { .. } => actions.push(Action::Finish(r)),
            }
            if s.requests[r] == Request::InFlight {
                actions.push(Action::Apply(r));
                actions.push(Action::Lose(r));
            }
            if s.relays[r] != Pc::Idle && s.crashes < MAX_CRASHES {
                actions.push(Action::Crash(r));
            }
        }
        if s.status == Status::Running && s.lease_valid {
            actions.push(Action::LeaseRunsOut);
        }
        if s.status == Status::Running && !s.lease_valid {
            actions.push(Action::Recover);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Claim(r) => {
                s.status = Status::Running;
                s.epoch += 1;
                s.lease_valid = true;
                let kind = if s.needs_verify {
                    Kind::Verify
                } else {
                    Kind::Call
                };
                s.history.push((kind, None));
                s.relays[r] = Pc::Claimed {
                    epoch: s.epoch,
                    verify: s.needs_verify,
                    seq: s.history.len() - 1,
                };
            }
            Action::FenceAndSend(r) => {
                let Pc::Claimed { epoch, seq, .. } = s.relays[r] else {
                    return None;
                };
                if s.epoch == epoch && s.lease_valid && s.status == Status::Running {
                    s.requests[r] = Request::InFlight;
                    s.relays[r] = Pc::Waiting { epoch, seq };
                } else {
                    s.relays[r] = Pc::Idle; // fenced out
                }
            }
            Action::Apply(r) => {
                s.requests[r] = Request::Applied;
                s.effects += 1;
            }
            Action::Lose(r) => s.requests[r] = Request::Lost,
            Action::Answer(r, success) => {
                let Pc::Waiting { epoch, seq } = s.relays[r] else {
                    return None;
                };
                s.requests[r] = Request::None;
                if success {
                    s.relays[r] = Pc::Finishing { epoch, seq };
                } else {
                    s.end_attempt(seq, Ended::Ambiguous);
                    s.relays[r] = match s.begin(epoch, Kind::Verify) {
                        Some(seq) => Pc::Verifying { epoch, seq },
                        None => Pc::Idle,
                    };
                }
            }
            Action::Verify(r, answer) => {
                let (epoch, seq) = match s.relays[r] {
                    Pc::Claimed { epoch, seq, .. } | Pc::Verifying { epoch, seq } => (epoch, seq),
                    _ => return None,
                };
                // Verification does not lie (assumption 3).
                let answer = match answer {
                    VerifyAnswer::Done if s.effects == 0 => return None,
                    VerifyAnswer::NotDone if s.effects > 0 => return None,
                    // Before the deadline a "not done" concludes nothing (assumption 1).
                    VerifyAnswer::NotDone if s.may_be_in_flight() => VerifyAnswer::Inconclusive,
                    a => a,
                };
                match answer {
                    VerifyAnswer::Done => s.relays[r] = Pc::Finishing { epoch, seq },
                    VerifyAnswer::NotDone => {
                        s.end_attempt(seq, Ended::NotDone);
                        // The next call's attempt, then its send (one step: assumption 2).
                        match s.begin(epoch, Kind::Call) {
                            Some(seq) => {
                                s.requests[r] = Request::InFlight;
                                s.relays[r] = Pc::Waiting { epoch, seq };
                            }
                            None => s.relays[r] = Pc::Idle,
                        }
                    }
                    VerifyAnswer::Inconclusive => {
                        s.end_attempt(seq, Ended::Inconclusive);
                        s.relays[r] = match s.begin(epoch, Kind::Verify) {
                            Some(seq) => Pc::Verifying { epoch, seq },
                            None => Pc::Idle,
                        };
                    }
                }
            }
            Action::Finish(r) => {
                let Pc::Finishing { epoch, seq } = s.relays[r] else {
                    return None;
                };
                // `FINISH_MANY`: fenced by epoch only; it closes the claim's last attempt.
                if s.epoch == epoch && s.status == Status::Running {
                    s.history[seq].1 = Some(Ended::Succeeded);
                    s.status = Status::Succeeded;
                    s.lease_valid = false;
                }
                s.relays[r] = Pc::Idle;
            }
            Action::Crash(r) => {
                s.relays[r] = Pc::Idle;
                s.crashes += 1;
            }
            Action::LeaseRunsOut => s.lease_valid = false,
            Action::Recover => {
                let had_open_call = s
                    .history
                    .last()
                    .is_some_and(|(k, e)| *k == Kind::Call && e.is_none());
                for attempt in &mut s.history {
                    if attempt.1.is_none() {
                        attempt.1 = Some(Ended::Abandoned);
                    }
                }
                let history: Vec<Past> = s
                    .history
                    .iter()
                    .map(|(kind, ended)| Past {
                        kind: *kind,
                        ended: *ended,
                        age: Duration::ZERO,
                    })
                    .collect();
                s.needs_verify = match self.rule {
                    Rule::AttemptLog => {
                        matches!(next_step(&history, true).next, Next::Verify { .. })
                    }
                    Rule::OpenCallOnly => s.needs_verify || had_open_call,
                };
                s.status = Status::Pending;
                s.epoch += 1;
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("the effect happens at most once", |_, s: &State| {
                s.effects <= 1
            }),
            Property::always("a key answered succeeded has its effect", |_, s: &State| {
                s.status != Status::Succeeded || s.effects == 1
            }),
            Property::sometimes("a key finishes", |_, s: &State| {
                s.status == Status::Succeeded
            }),
        ]
    }

    fn within_boundary(&self, s: &State) -> bool {
        s.history.len() <= self.max_history
    }
}

#[test]
fn the_protocol_never_doubles_an_effect() {
    let checker = Protocol {
        rule: Rule::AttemptLog,
        max_history: max_history(),
    }
    .checker()
    .spawn_bfs()
    .join();
    checker.assert_properties();
    println!("states explored: {}", checker.unique_state_count());
    assert!(
        checker.unique_state_count() > 1000,
        "the model explored something"
    );
}

/// The rule of the code before issue 12, in the same model: the checker must find the double
/// effect (a relay dies while verifying an ambiguous call; recovery sees no open call).
#[test]
fn the_rule_before_issue_12_is_caught_doubling_an_effect() {
    let checker = Protocol {
        rule: Rule::OpenCallOnly,
        max_history: max_history(),
    }
    .checker()
    .spawn_bfs()
    .join();
    let path = checker
        .discovery("the effect happens at most once")
        .expect("a counterexample");
    println!("counterexample: {:?}", path.into_actions());
}
