-- Gates for what cannot be undone: approvals, per-run limits, retention and tombstones.

-- One decision per intent: a second approve, or an approve racing a deny, loses on the key.
create table approvals (
    id               bigserial   primary key,
    intent_id        bigint      not null unique references intents (id) on delete cascade,
    idempotency_key  text        not null,
    -- The material fingerprint the decision was made for.
    fingerprint      text        not null,
    decision         text        not null check (decision in ('approved', 'denied', 'expired')),
    decided_by       text        not null,
    reason           text        not null,
    at               timestamptz not null default now()
);

-- Distinct intents per run and tool ('*' counts the run across tools), counted in the
-- transaction that records them.
create table run_counts (
    run_id  text    not null,
    tool    text    not null,
    n       integer not null,
    primary key (run_id, tool)
);

-- What is left of a pruned key, so a resumed run cannot execute it again as new.
create table tombstones (
    key_hash          text        primary key,
    fingerprint_hash  text        not null,
    tool              text        not null,
    status            text        not null,
    finished_at       timestamptz,
    pruned_at         timestamptz not null default now(),
    expires_at        timestamptz not null
);

create index tombstones_expiry on tombstones (expires_at);
create index intents_reattempts on intents (run_id, tool, business_id) where status = 'failed';
create index intents_finished on intents (tool, finished_at)
    where status in ('succeeded', 'failed', 'rejected');
create index intents_parked on intents (tool, created_at) where status in ('pending_approval', 'unknown');
