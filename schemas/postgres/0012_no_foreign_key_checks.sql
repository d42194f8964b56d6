-- Deliveries and attempts no longer reference their intent by a foreign key; a trigger deletes
-- them with it instead. The foreign keys' cascade was used by pruning alone, but their check ran
-- on every delivery and attempt written: a query per row locking the intent (`for key share`),
-- run at the end of each statement. At 1,000 actions/s, where batches are a few actions, that was
-- about 7 % of Postgres' CPU (ten alternating pairs of runs against the previous schema).
--
-- What the check guarded is kept by the order of the writers' locks. A delivery or an attempt is
-- written for an intent its transaction inserted, or one it holds a lock on: repeats read their
-- key `for share`, claims, verifications and resolutions lock the intent `for update`. Pruning
-- takes its intents `for update skip locked`, so it never deletes one such a transaction holds,
-- and a transaction that comes after it waits and then finds the key gone (a tombstone).
-- (Since stop 45, a repeat of a key settled within the last 12 hours reads it without the lock:
-- no prune reaches a key within half the shortest retention, 24 hours.)
--
-- The trigger runs once per delete statement, after it, over the deleted rows; its deletes see
-- what other transactions committed up to then. Relays of migrations 10 and 11 prune through the
-- same trigger, so they may still run beside this one (the floor is unchanged).
alter table deliveries drop constraint deliveries_intent_id_fkey;
alter table attempts drop constraint attempts_intent_id_fkey;

create function intents_gone() returns trigger
language plpgsql
set search_path from current
as $$
begin
    delete from deliveries where intent_id in (select id from gone);
    delete from attempts where intent_id in (select id from gone);
    return null;
end
$$;

create trigger intents_gone
    after delete on intents
    referencing old table as gone
    for each statement
    execute function intents_gone();
