use std::time::{Duration, Instant};

use crate::config::{ExecutorKind, Tool, ToolClass};
use crate::execute::http::{self, Attempt, Verified};
use crate::outcome::OutcomeStatus;
use crate::outcome::Settled;

use crate::execute::claim::{AttemptEnd, Claimed};

use super::*;

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
    ) -> Result<(Settled, AttemptEnd), ExecError> {
        let ExecutorKind::Http(exec) = &tool.executor else {
            unreachable!("http tool")
        };
        let data = action_data(c);
        let url = http::fill_url(&exec.url, &c.key, &data);
        let verify_url = tool
            .verify
            .as_ref()
            .map(|v| http::fill_url(&v.url, &c.key, &data));
        let mut seq = c.seq;
        let mut verifying = c.needs_verify;
        let mut calls = 0;
        let mut verifications = 0;
        // Until the last call that may have happened has run out its timeout, the downstream
        // may still be processing it: a "not done" before then concludes nothing.
        let mut deadline = if c.needs_verify {
            c.since_call
                .map(|age| Instant::now() + exec.timeout.saturating_sub(age))
        } else {
            None
        };
        let reason = c.reason.clone();
        let why_next = |calls: i32| {
            if calls == 0 {
                reason.clone()
            } else {
                "transport_retry".to_string()
            }
        };
        loop {
            if verifying {
                let (v, url) = (tool.verify.as_ref(), verify_url.as_deref());
                let (Some(v), Some(url)) = (v, url) else {
                    let end = AttemptEnd::new(
                        seq,
                        "inconclusive",
                        None,
                        Some("no verify configured".into()),
                        Duration::ZERO,
                    );
                    return Ok((
                        self.unknown(tool, "no verify is configured for this tool", calls),
                        end,
                    ));
                };
                crash_point!("before-verify");
                let (verified, status, took) = http::verify(&self.http, v, url, &c.key).await;
                let status = status.map(i32::from);
                let verified = match (verified, deadline) {
                    (Verified::NotDone, Some(d)) if Instant::now() < d => Verified::Premature(d),
                    (v, _) => v,
                };
                match verified {
                    Verified::Done(result) => {
                        self.metrics.verification(&tool.name, "done");
                        self.metrics.side_effect(&tool.name);
                        let end = AttemptEnd::new(seq, "done", status, None, took);
                        return Ok((
                            Settled::new(OutcomeStatus::Succeeded, Some(result), None, calls),
                            end,
                        ));
                    }
                    Verified::NotDone => {
                        self.metrics.verification(&tool.name, "not_done");
                        let end = AttemptEnd::new(seq, "not_done", status, None, took);
                        if c.attempts + calls >= tool.retry.max_attempts as i32 {
                            // The outcome transaction closes this attempt.
                            return Ok((
                                Settled::not_done(
                                    ErrorCode::DownstreamUnavailable,
                                    format!(
                                        "not done after {} attempts (verified)",
                                        c.attempts + calls
                                    ),
                                    calls,
                                ),
                                end,
                            ));
                        }
                        self.end(c, end).await?;
                        // Certainly not done: safe to call again.
                        seq = self.begin(c, "call", &why_next(calls)).await?;
                        verifying = false;
                        self.metrics.retry(&tool.name, "verified_not_done");
                        continue;
                    }
                    Verified::Premature(until) => {
                        self.metrics.verification(&tool.name, "inconclusive");
                        let detail = "not done so far, but the call may still be in flight until its timeout";
                        self.end(
                            c,
                            AttemptEnd::new(seq, "inconclusive", status, Some(detail.into()), took),
                        )
                        .await?;
                        crash_point!("verify-backoff");
                        tokio::time::sleep_until(until.into()).await;
                        seq = self.begin(c, "verify", &why_next(calls)).await?;
                        continue;
                    }
                    Verified::Inconclusive(detail) => {
                        verifications += 1;
                        self.metrics.verification(&tool.name, "inconclusive");
                        if verifications >= v.max_attempts {
                            let end = AttemptEnd::new(
                                seq,
                                "inconclusive",
                                status,
                                Some(detail.clone()),
                                took,
                            );
                            return Ok((self.unknown(tool, &format!("verification inconclusive after {verifications} tries: {detail}"), calls), end));
                        }
                        self.end(
                            c,
                            AttemptEnd::new(seq, "inconclusive", status, Some(detail), took),
                        )
                        .await?;
                        crash_point!("verify-backoff");
                        tokio::time::sleep(
                            Backoff::new(v.backoff, v.backoff * 16).delay(verifications, None),
                        )
                        .await;
                        seq = self.begin(c, "verify", &why_next(calls)).await?;
                        continue;
                    }
                }
            }

            if c.attempts + calls >= tool.retry.max_attempts as i32 {
                // Earlier claims spent the budget (calls that may have happened count, and
                // verification said they did not).
                let message = format!(
                    "not done, and the {} calls allowed were all made",
                    tool.retry.max_attempts
                );
                let end = AttemptEnd::new(
                    seq,
                    "not_sent",
                    None,
                    Some("retry budget spent".into()),
                    Duration::ZERO,
                );
                return Ok((
                    Settled::not_done(ErrorCode::DownstreamUnavailable, message, calls),
                    end,
                ));
            }
            if waited && calls == 0 && seq == c.seq {
                // Claimed when recorded, then queued: the claim must still be ours.
                self.fence(c).await?;
            }
            calls += 1;
            deadline = Some(Instant::now() + exec.timeout);
            let (attempt, took) = http::call(
                &self.http,
                exec,
                &url,
                &c.key,
                &c.args,
                c.traceparent.as_deref(),
            )
            .await;
            self.metrics
                .side_effect_duration(&tool.name, took.as_secs_f64());
            let end = AttemptEnd::new(
                seq,
                attempt.classification(),
                attempt.http_status().map(i32::from),
                attempt.detail(),
                took,
            );
            let spent = c.attempts + calls >= tool.retry.max_attempts as i32;
            let wait = match &attempt {
                Attempt::Succeeded(result) => {
                    self.metrics.side_effect(&tool.name);
                    return Ok((
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
                    return Ok((settled, end));
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
                        return Ok((
                            Settled::not_done(ErrorCode::DownstreamUnavailable, message, calls),
                            end,
                        ));
                    }
                    Backoff::of(&tool.retry).delay(calls as u32, *retry_after)
                }
                Attempt::NotSent(why) => {
                    if spent {
                        let message = format!("{why} (after {} attempts)", c.attempts + calls);
                        return Ok((
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
                            return Ok((self.unknown(tool, why, calls), end));
                        }
                        self.end(c, end).await?;
                        seq = self.begin(c, "verify", "transport_retry").await?;
                        verifying = true;
                        continue;
                    }
                    if spent {
                        return Ok((self.unknown(tool, why, calls), end));
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
            tokio::time::sleep(wait).await;
            seq = self.begin(c, "call", "transport_retry").await?;
        }
    }
}
