"""The outcome event idem publishes for every action event, as a typed value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

Status = Literal["succeeded", "failed", "unknown", "pending_approval", "rejected"]


@dataclass(frozen=True)
class OutcomeError:
    """Why an action was not done (``failed``, ``rejected``) or may not have been (``unknown``)."""

    code: str
    """Machine-readable: ``key_conflict``, ``downstream_rejected``, ``outcome_unknown``, …"""
    message: str
    retryable: bool
    """Whether a *new* request may succeed later (the downstream was unavailable)."""
    fields: list[str] = field(default_factory=list)
    """For ``key_conflict``: the material fields that differ from the first request."""


@dataclass(frozen=True)
class Outcome:
    """One outcome event: what became of an action, and the sentence to show the model."""

    id: str
    """The CloudEvent id: stable per (key, status change) and per answered action event."""
    status: Status
    idempotency_key: str
    action_event_id: str
    """The action event this outcome answers (what :meth:`Idem.call` published)."""
    run_id: str | None
    step: int | None
    tool: str | None
    result: Any
    """The downstream's result: its JSON body, or the first one's for a duplicate."""
    error: OutcomeError | None
    duplicate: bool
    """True when this answers a repeat: the effect was not performed again."""
    attempts: int
    note: str
    """One plain sentence for the model, e.g. "Already done …; not repeated. Do not retry."."""
    raw: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)
    """The whole CloudEvent as received."""

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> "Outcome":
        data = event["data"]
        error = data.get("error")
        return cls(
            id=event["id"],
            status=data["status"],
            idempotency_key=data["idempotency_key"],
            action_event_id=data["action_event_id"],
            run_id=data.get("run_id"),
            step=data.get("step"),
            tool=data.get("tool"),
            result=data.get("result"),
            error=None
            if error is None
            else OutcomeError(
                code=error["code"],
                message=error["message"],
                retryable=bool(error.get("retryable", False)),
                fields=list(error.get("fields") or []),
            ),
            duplicate=bool(data.get("duplicate", False)),
            attempts=int(data.get("attempts", 0)),
            note=data.get("note", ""),
            raw=event,
        )

    @property
    def final(self) -> bool:
        """Whether the key has settled: anything but ``pending_approval``. (``unknown`` is final
        until a person resolves it.)"""
        return self.status != "pending_approval"
