//! The http call loop of one claim: call, retry what certainly did not happen, verify what may
//! have. Calling and verifying are separate steps that hand over to each other.

use std::time::Instant;

use crate::config::{ExecutorKind, HttpExecutor, Tool, ToolClass};
use crate::execute::http::{self, Attempt, Verified};
use crate::outcome::OutcomeStatus;
use crate::outcome::Settled;

use crate::execute::claim::{sends_unfenced, AttemptEnd, Claimed, FRESH_CLAIM};

use super::*;

/// What one step of the loop leads to.
enum Step {
    Call,
    Verify,
    /// The outcome, and the attempt it ends on (closed by the outcome transaction).
    Done(Settled, AttemptEnd),
}

/// Where one claim's loop stands.
struct Run<'a> {
    c: &'a Claimed,
    tool: &'a Tool,
    exec: &'a HttpExecutor,
    url: String,
    verify_url: Option<String>,
    /// The claim was made when the intent was recorded and waited in the queue since: its
    /// lease is re-checked before the first send.
    waited: bool,
    /// The attempt row open now.
    seq: i32,
    /// Calls this claim made.
    calls: i32,
    /// Inconclusive verifications in a row.
    verifications: u32,
    /// Until the last call that may have happened has run out its timeout, the downstream may
    /// still be processing it: a "not done" before then concludes nothing.
    deadline: Option<Instant>,
    /// The result announced to the finish groups ([`GroupCommit::expect`]), withdrawn while
    /// the loop waits to call or verify again.
    announced: &'a mut Option<Expected>,
}

impl Run<'_> {
    /// The reason recorded on the next attempt.
    fn why_next(&self) -> String {
        if self.calls == 0 {
            self.c.reason.clone()
        } else {
            "transport_retry".to_string()
        }
    }

    /// The retry budget is spent (calls of earlier claims count).
    fn spent(&self) -> bool {
        self.c.attempts + self.calls >= self.tool.retry.max_attempts as i32
    }
}

impl Executor {
    /// Runs the http call with the tool's retry policy, logging every attempt. Retries only
    /// when the effect certainly did not happen, or when the tool is idempotent; an ambiguous
    /// result of a dangerous tool is verified downstream, or parked `unknown`. `waited`: the
    /// claim was made when the intent was recorded and waited in the queue since, so its lease
    /// is re-checked before the first send.
    pub(super) async fn call_http(
        &self,
        tool: &Tool,
        c: &Claimed,
        waited: bool,
        announced: &mut Option<Expected>,
    ) -> Result<(Settled, AttemptEnd), ExecError> {
        let ExecutorKind::Http(exec) = &tool.executor else {
            unreachable!("http tool")
        };
        let data = action_data(c);
        let mut run = Run {
            c,
            tool,
            exec,
            url: http::fill_url(&exec.url, &c.key, &data),
            verify_url: tool
                .verify
                .as_ref()
                .map(|v| http::fill_url(&v.url, &c.key, &data)),
            waited,
            seq: c.seq,
            calls: 0,
            verifications: 0,
            deadline: if c.needs_verify {
                // The call's start was recorded up to FRESH_CLAIM before it was sent.
                c.since_call
                    .map(|age| Instant::now() + (exec.timeout + FRESH_CLAIM).saturating_sub(age))
            } else {
                None
            },
            announced,
        };
        let mut step = if c.needs_verify {
            Step::Verify
        } else {
            Step::Call
        };
        loop {
            step = match step {
                Step::Call => self.call_once(&mut run).await?,
                Step::Verify => self.verify_once(&mut run).await?,
                Step::Done(settled, end) => return Ok((settled, end)),
            };
        }
    }

    /// Waits out `sleep` with the call's result no longer announced: a finish group forming
    /// meanwhile does not wait for a result that far off.
    async fn pause(&self, run: &mut Run<'_>, sleep: impl std::future::Future<Output = ()>) {
        let announced = run.announced.take().is_some();
        sleep.await;
        if announced {
            // With the calls starting now: its result comes with theirs.
            *run.announced = self.announce(&run.tool.name);
        }
    }

    /// Asks the downstream whether the effect happened.
    async fn verify_once(&self, run: &mut Run<'_>) -> Result<Step, ExecError> {
        let (c, tool, seq, calls) = (run.c, run.tool, run.seq, run.calls);
        let (Some(v), Some(url)) = (tool.verify.as_ref(), run.verify_url.as_deref()) else {
            let end = AttemptEnd::unsent(seq, "inconclusive", "no verify configured");
            return Ok(Step::Done(
                self.unknown(tool, "no verify is configured for this tool", calls),
                end,
            ));
        };
        crash_point!("before-verify");
        let span = Attempted::start(c, "verify", seq);
        let (verified, status, took) = http::verify(
            self.http.of(tool),
            v,
            url,
            &c.key,
            span.traceparent(c).as_deref(),
        )
        .await;
        span.end(
            tool,
            v.method.as_str(),
            url,
            status,
            match &verified {
                Verified::Done(_) => "done",
                Verified::NotDone => "not_done",
                _ => "inconclusive",
            },
            false,
        );
        let status = status.map(i32::from);
        let verified = match (verified, run.deadline) {
            (Verified::NotDone, Some(d)) if Instant::now() < d => Verified::Premature(d),
            (v, _) => v,
        };
        match verified {
            Verified::Done(result) => {
                self.metrics.verification(&tool.name, "done");
                self.metrics.side_effect(&tool.name);
                let end = AttemptEnd::new(seq, "done", status, None, took);
                Ok(Step::Done(
                    Settled::new(OutcomeStatus::Succeeded, Some(result), None, calls),
                    end,
                ))
            }
            Verified::NotDone => {
                self.metrics.verification(&tool.name, "not_done");
                let end = AttemptEnd::new(seq, "not_done", status, None, took);
                if run.spent() {
                    // The outcome transaction closes this attempt.
                    return Ok(Step::Done(
                        Settled::not_done(
                            ErrorCode::DownstreamUnavailable,
                            format!("not done after {} attempts (verified)", c.attempts + calls),
                            calls,
                        ),
                        end,
                    ));
                }
                self.end(c, end).await?;
                // Certainly not done: safe to call again.
                run.seq = self.begin(c, "call", &run.why_next()).await?;
                self.metrics.retry(&tool.name, "verified_not_done");
                Ok(Step::Call)
            }
            Verified::Premature(until) => {
                self.metrics.verification(&tool.name, "inconclusive");
                let detail =
                    "not done so far, but the call may still be in flight until its timeout";
                self.end(
                    c,
                    AttemptEnd::new(seq, "inconclusive", status, Some(detail.into()), took),
                )
                .await?;
                crash_point!("verify-backoff");
                self.pause(run, tokio::time::sleep_until(until.into()))
                    .await;
                run.seq = self.begin(c, "verify", &run.why_next()).await?;
                Ok(Step::Verify)
            }
            Verified::Inconclusive(detail) => {
                run.verifications += 1;
                let verifications = run.verifications;
                self.metrics.verification(&tool.name, "inconclusive");
                if verifications >= v.max_attempts {
                    let end =
                        AttemptEnd::new(seq, "inconclusive", status, Some(detail.clone()), took);
                    let why =
                        format!("verification inconclusive after {verifications} tries: {detail}");
                    return Ok(Step::Done(self.unknown(tool, &why, calls), end));
                }
                self.end(
                    c,
                    AttemptEnd::new(seq, "inconclusive", status, Some(detail), took),
                )
                .await?;
                crash_point!("verify-backoff");
                let backoff = Backoff::new(v.backoff, v.backoff * 16).delay(verifications, None);
                self.pause(run, tokio::time::sleep(backoff)).await;
                run.seq = self.begin(c, "verify", &run.why_next()).await?;
                Ok(Step::Verify)
            }
        }
    }

    /// Makes one call, unless the budget is spent; decides what follows from what is known of
    /// its effect.
    async fn call_once(&self, run: &mut Run<'_>) -> Result<Step, ExecError> {
        let (c, tool, exec) = (run.c, run.tool, run.exec);
        if run.spent() {
            // Earlier claims spent the budget (calls that may have happened count, and
            // verification said they did not).
            let message = format!(
                "not done, and the {} calls allowed were all made",
                tool.retry.max_attempts
            );
            let end = AttemptEnd::unsent(run.seq, "not_sent", "retry budget spent");
            return Ok(Step::Done(
                Settled::not_done(ErrorCode::DownstreamUnavailable, message, run.calls),
                end,
            ));
        }
        if run.waited
            && run.calls == 0
            && run.seq == c.seq
            && !sends_unfenced(c.claimed_at.elapsed(), self.lease, exec.timeout)
        {
            // Claimed when recorded, then queued for long: the claim must still be ours. (The
            // monotonic clock runs while the process is stopped, so a relay paused past its
            // lease is fenced here.)
            self.fence(c).await?;
        }
        run.calls += 1;
        let calls = run.calls;
        run.deadline = Some(Instant::now() + exec.timeout);
        let span = Attempted::start(c, "call", run.seq);
        let (attempt, took) = http::call(
            self.http.of(tool),
            exec,
            &run.url,
            &c.key,
            &c.args,
            span.traceparent(c).as_deref(),
        )
        .await;
        span.end(
            tool,
            exec.method.as_str(),
            &run.url,
            attempt.http_status(),
            attempt.classification(),
            !matches!(attempt, Attempt::Succeeded(_)),
        );
        self.metrics
            .side_effect_duration(&tool.name, took.as_secs_f64());
        let end = AttemptEnd::new(
            run.seq,
            attempt.classification(),
            attempt.http_status().map(i32::from),
            attempt.detail(),
            took,
        );
        let spent = run.spent();
        let wait = match &attempt {
            Attempt::Succeeded(result) => {
                self.metrics.side_effect(&tool.name);
                return Ok(Step::Done(
                    Settled::new(OutcomeStatus::Succeeded, Some(result.clone()), None, calls),
                    end,
                ));
            }
            Attempt::Failed { status, body } => {
                let settled = Settled::new(
                    OutcomeStatus::Failed,
                    Some(body.clone()),
                    Some(
                        ErrorCode::DownstreamRejected
                            .error(format!("the downstream answered {status}")),
                    ),
                    calls,
                );
                return Ok(Step::Done(settled, end));
            }
            Attempt::Retry {
                status,
                retry_after,
            } => {
                if spent {
                    let message = format!(
                        "the downstream answered {status} on each of {} attempts",
                        c.attempts + calls
                    );
                    return Ok(Step::Done(
                        Settled::not_done(ErrorCode::DownstreamUnavailable, message, calls),
                        end,
                    ));
                }
                Backoff::of(&tool.retry).delay(calls as u32, *retry_after)
            }
            Attempt::NotSent(why) => {
                if spent {
                    let message = format!("{why} (after {} attempts)", c.attempts + calls);
                    return Ok(Step::Done(
                        Settled::not_done(ErrorCode::DownstreamUnreachable, message, calls),
                        end,
                    ));
                }
                Backoff::of(&tool.retry).delay(calls as u32, None)
            }
            Attempt::Ambiguous { reason: why, .. } => {
                if tool.class == ToolClass::Dangerous {
                    // Never a blind retry of a dangerous write: look downstream first.
                    if tool.verify.is_none() {
                        return Ok(Step::Done(self.unknown(tool, why, calls), end));
                    }
                    self.end(c, end).await?;
                    run.seq = self.begin(c, "verify", "transport_retry").await?;
                    return Ok(Step::Verify);
                }
                if spent {
                    return Ok(Step::Done(self.unknown(tool, why, calls), end));
                }
                Backoff::of(&tool.retry).delay(calls as u32, None)
            }
        };
        self.metrics.retry(&tool.name, attempt.retry_reason());
        tracing::info!(
            attempt = calls,
            wait_ms = wait.as_millis() as u64,
            reason = attempt.retry_reason(),
            "retrying"
        );
        self.end(c, end).await?;
        self.pause(run, tokio::time::sleep(wait)).await;
        run.seq = self.begin(c, "call", "transport_retry").await?;
        Ok(Step::Call)
    }
}

/// One attempt's span (when traces are exported): started before the request, so the
/// downstream receives the attempt's own `traceparent`, and exported when it ends.
struct Attempted {
    trace: Option<(crate::telemetry::ActionTrace, opentelemetry::trace::SpanId)>,
    kind: &'static str,
    seq: i32,
    start: std::time::SystemTime,
}

impl Attempted {
    fn start(c: &Claimed, kind: &'static str, seq: i32) -> Self {
        let trace = crate::telemetry::enabled().then(|| {
            let t = crate::telemetry::ActionTrace::of(&c.key, c.traceparent.as_deref());
            let id = t.child(&format!("attempt/{seq}"));
            (t, id)
        });
        Self {
            trace,
            kind,
            seq,
            start: std::time::SystemTime::now(),
        }
    }

    /// What the downstream receives: the attempt's context, or the incoming one unchanged
    /// when traces are not exported.
    fn traceparent(&self, c: &Claimed) -> Option<String> {
        match &self.trace {
            Some((t, id)) => Some(t.traceparent(*id)),
            None => c.traceparent.clone(),
        }
    }

    fn end(
        self,
        tool: &Tool,
        method: &str,
        url: &str,
        status: Option<u16>,
        result: &str,
        error: bool,
    ) {
        use crate::telemetry::{Attribute, Kind, Span};
        let Some((trace, id)) = self.trace else {
            return;
        };
        let mut attributes = vec![
            Attribute::new("http.request.method", method.to_string()),
            Attribute::new("url.full", url.to_string()),
            Attribute::new("idem.attempt.kind", self.kind),
            Attribute::new("idem.attempt.seq", i64::from(self.seq)),
            Attribute::new("idem.attempt.result", result.to_string()),
        ];
        if let Some(s) = status {
            attributes.push(Attribute::new("http.response.status_code", i64::from(s)));
        }
        trace.emit_child(
            id,
            Span {
                name: format!("{} {}", self.kind, tool.name),
                kind: Kind::Client,
                start: self.start,
                end: std::time::SystemTime::now(),
                attributes,
                error: error.then(|| result.to_string()),
            },
        );
    }
}
