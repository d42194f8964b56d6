-- Intents, deliveries and the outbox: the state that makes each side effect happen once.

-- One row per intended effect. For read_only tools one row per delivery (never deduplicated).
create table intents (
    id                bigserial primary key,
    idempotency_key   text        not null,
    tool              text        not null,
    class             text        not null check (class in ('read_only', 'idempotent', 'dangerous')),
    run_id            text        not null,
    step              bigint,
    business_id       text,
    args              jsonb       not null,
    -- Material field values, so a conflict can name the fields that differ.
    material          jsonb       not null,
    fingerprint       text        not null,
    -- Hash of all args: tells a replay (identical) from a model retry (reworded).
    args_hash         text        not null,
    action_event_id   text        not null,
    source_topic      text        not null,
    source_partition  integer     not null,
    source_offset     bigint      not null,
    traceparent       text,
    event_time        timestamptz,
    status            text        not null default 'pending' check (status in
                          ('pending', 'running', 'succeeded', 'failed', 'unknown', 'rejected', 'pending_approval')),
    result            jsonb,
    error             jsonb,
    attempts          integer     not null default 0,
    -- Counts reported status changes; outcome event ids derive from it, so they are stable.
    status_seq        integer     not null default 0,
    lease_owner       text,
    lease_expires_at  timestamptz,
    -- Fencing token: a write must carry the epoch of the claim it was made under.
    lease_epoch       bigint      not null default 0,
    created_at        timestamptz not null default now(),
    updated_at        timestamptz not null default now(),
    finished_at       timestamptz
);

create unique index intents_key on intents (idempotency_key) where class <> 'read_only';
create index intents_open on intents (status, updated_at) where status in ('pending', 'running');

-- Every action message read, with the layer that caused it when it is a repeat.
create table deliveries (
    id                bigserial   primary key,
    intent_id         bigint      references intents (id) on delete cascade,
    idempotency_key   text        not null,
    action_event_id   text        not null,
    source_topic      text        not null,
    source_partition  integer     not null,
    source_offset     bigint      not null,
    origin            text        not null check (origin in
                          ('first', 'redelivery', 'producer_retry', 'replay', 'model_retry', 'conflict', 'dead_letter')),
    received_at       timestamptz not null default now(),
    -- False while a repeat waits for its key to resolve (the first delivery is answered by the
    -- key's own outcomes).
    answered          boolean     not null default false
);

create index deliveries_event on deliveries (action_event_id);
create index deliveries_waiting on deliveries (intent_id) where not answered;
create index deliveries_key on deliveries (idempotency_key);

-- Outcome events, written in the transaction that decided them and published from here.
create table outbox (
    id            bigserial   primary key,
    event_id      text        not null unique,
    kafka_key     text        not null,
    payload       jsonb       not null,
    traceparent   text,
    created_at    timestamptz not null default now(),
    published_at  timestamptz
);

create index outbox_unpublished on outbox (id) where published_at is null;
create index outbox_key on outbox (kafka_key);
