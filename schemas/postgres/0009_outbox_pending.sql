-- The ids of unpublished outbox rows: a narrow queue the publisher reads in id order and
-- deletes from once Kafka acknowledged a row. Marking a wide outbox row published leaves a dead
-- entry in the partial index of unpublished rows until a vacuum, and autovacuum visits the
-- outbox only after a fifth of its rows changed (two million marks with ten million keys): a
-- publisher walking that index from its oldest entry read more dead entries every round. This
-- table stays small, and the publisher vacuums it every few seconds.
--
-- A trigger fills it, so rows written by relays of the previous version (during a rolling
-- upgrade) are queued too; those relays still find and mark rows by `published_at`, which every
-- version keeps setting, and a queued row whose outbox row is published or quarantined is
-- dropped from the queue when the publisher meets it.
-- Never truncated by a vacuum: that takes an exclusive lock, and the pages at the end of a queue
-- empty all the time.
create table outbox_pending (
    id bigint primary key
) with (vacuum_truncate = false);

insert into outbox_pending (id)
select id from outbox where published_at is null and quarantined_at is null;

create function outbox_pending_add() returns trigger
language plpgsql
set search_path from current
as $$
begin
    insert into outbox_pending (id)
    select id from added where published_at is null and quarantined_at is null;
    return null;
end
$$;

create trigger outbox_pending_add
    after insert on outbox
    referencing new table as added
    for each statement
    execute function outbox_pending_add();
