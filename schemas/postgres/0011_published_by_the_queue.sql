-- An outbox row is published once its id has left the queue (`outbox_pending`, migration 9):
-- relays from this version on delete the id when Kafka acknowledged the row and write nothing to
-- the row itself. The mark they used to set as well (`published_at`) was an update of a wide
-- row that could not be HOT (the partial index below names the column), so it rewrote the
-- outcome and added an entry to each of the outbox's indexes: about a fifth of the WAL of a new
-- action. `published_at` stays, set only by relays of earlier versions; a row whose id is still
-- queued but which such a relay marked is dropped from the queue without going out again.
--
-- Nothing reads this index any more: publishers read the queue, the lag gauge counts it.
-- Relays of the previous version (migration 10) may run beside this one during a rolling
-- upgrade: they read the queue too, and take a row published here (still unmarked) for one that
-- is not only where that is safe (a repeat of its key is answered through the outbox rather
-- than straight to Kafka; their pruning leaves its outbox row). Relays from before migration 9
-- find unpublished rows by `published_at` and would publish such rows again: they must not run
-- against this schema (upgrade through a version with migration 9 or 10 first).
drop index outbox_unpublished;

-- The oldest relay that may run against this schema, as the newest migration a relay must know:
-- a relay that knows fewer refuses to start (relays from this version on check it; those before
-- do not, hence the rule above). A later migration that older relays cannot work beside raises
-- it; one they can leaves it.
create table idem_relay_floor (migration integer not null);
insert into idem_relay_floor (migration) values (10);
