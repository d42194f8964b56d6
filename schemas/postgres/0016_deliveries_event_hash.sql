-- The deliveries' index by event id becomes a hash index. It is searched by equality alone (a
-- batch's seen events, `action_event_id = any($1)`): every action message's event id is looked
-- up in it, and every repeat writes it. A hash index's entry is the id's 4-byte hash; a B-tree's
-- holds the id itself, ordered by the database's collation and compared at every level of every
-- descent.
--
-- Measured (pgbench, two tables of 2,000,000 deliveries alike but for this index, alternating
-- rounds of eight seconds in one session; `benches/HISTORY.md`, stop 44): 500 probes (the
-- seen-event read's generic plan, mostly misses) 3.5–4.3 ms against 5.5–6.5; 500 inserts
-- 11.5–13.3 ms against 14.1–17.4; the index 73 MB against 113 MB, both freshly built.
--
-- The table's exclusive lock is taken first. `idem migrate` takes it before any migration
-- pending with this one (migration 15's index build would otherwise hold a weaker lock on the
-- table that this one's would then wait to strengthen, while a relay's batch that has read the
-- deliveries waits to write them behind it: a deadlock). Building reads the deliveries once
-- (about four and a half seconds per million rows on the benchmark machine, in a slow hour),
-- and the relays' reads and writes of deliveries wait meanwhile (a statement of theirs that
-- waits past its `lock_timeout` is retried). Relays of migrations 10 to 15 may run beside this
-- one (the floor is unchanged): their statements find deliveries by event id by equality
-- alone, and are planned again for the new index.
lock table deliveries in access exclusive mode;
drop index deliveries_event;
create index deliveries_event on deliveries using hash (action_event_id);
