-- The attempt log: a durable row before every downstream call or verification, closed after it.
-- An attempt that began and never ended is the mark of an ambiguous call.

create table attempts (
    id               bigserial   primary key,
    intent_id        bigint      not null references intents (id) on delete cascade,
    idempotency_key  text        not null,
    -- Numbers every call and verification of the key, in order.
    seq              integer     not null,
    kind             text        not null check (kind in ('call', 'verify')),
    reason           text        not null check (reason in
                         ('first', 'transport_retry', 'redelivery', 'recovery', 'manual')),
    owner            text        not null,
    lease_epoch      bigint      not null,
    started_at       timestamptz not null default now(),
    ended_at         timestamptz,
    -- succeeded, failed, retry, not_sent, ambiguous (calls); done, not_done, inconclusive
    -- (verifications); abandoned (the relay died during it).
    classification   text,
    http_status      integer,
    error            text,
    latency_ms       double precision,
    unique (intent_id, seq)
);

create index attempts_key on attempts (idempotency_key);
create index attempts_open on attempts (intent_id) where ended_at is null;

-- Set by recovery when a dangerous call may have happened: look downstream before anything else.
alter table intents add column needs_verify boolean not null default false;
-- Why the next call is made: recovery after a crash, or a person's `idem resolve --as retry`.
alter table intents add column next_reason text not null default 'first'
    check (next_reason in ('first', 'recovery', 'manual'));

-- Decisions by people, with who and why.
create table resolutions (
    id               bigserial   primary key,
    intent_id        bigint      not null references intents (id) on delete cascade,
    idempotency_key  text        not null,
    from_status      text        not null,
    resolved_as      text        not null check (resolved_as in ('succeeded', 'failed', 'retry')),
    resolved_by      text        not null,
    reason           text        not null,
    at               timestamptz not null default now()
);

create index resolutions_key on resolutions (idempotency_key);
