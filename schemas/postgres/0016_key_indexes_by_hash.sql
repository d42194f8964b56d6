-- Two indexes on text that are searched by equality alone become hash indexes: the deliveries'
-- by event id (a batch's seen events, `action_event_id = any($1)`) and the outbox's by key (a
-- key's queued outcomes, its explanation, its pruning). A hash index's entry is the value's
-- 4-byte hash; a B-tree's holds the text itself, ordered by the database's collation and
-- compared at every level of every descent. Every action message probes the first, every
-- repeat writes it, and every outcome written through the outbox writes the second.
--
-- Measured (pgbench, pairs of tables of 2,000,000 rows alike but for the index, alternating
-- rounds of eight seconds in one session; `benches/HISTORY.md`, stop 44): the seen-event read
-- of 500 ids (mostly misses) 3.5–3.8 ms against 5.9–6.5; 500 deliveries inserted 11.5–12.2 ms
-- against 14.6–15.0; 500 outbox rows inserted 20.7–24.5 ms against 27.9–30.5 in five rounds of
-- six. The deliveries' index 73 MB against 113 MB, the outbox's 88 against 166.
--
-- Both tables are locked at once, deliveries first as the relays' batches take them: an index
-- dropped or built later in this transaction would wait for its table's lock while holding the
-- other's, and a relay's prune (which writes the outbox, then the deliveries) could then
-- deadlock with it. Building reads each table once (about four seconds per million rows on the
-- benchmark machine, in a slow hour); the relays' reads and writes of the two tables wait
-- meanwhile (a statement of theirs that waits past its `lock_timeout` is retried). Relays of
-- migrations 10 to 15 may run beside this one (the floor is unchanged): their statements search
-- these two columns by equality alone, and are planned again for the new indexes. One of
-- theirs, the keys behind a publishing round, may then be planned as a walk of the outbox's ids
-- below the round's last while the outbox is small, as this version's was on an empty outbox
-- before it compared the id in a form no index serves.
lock table deliveries, outbox in access exclusive mode;
drop index deliveries_event;
create index deliveries_event on deliveries using hash (action_event_id);
drop index outbox_key;
create index outbox_key on outbox using hash (kafka_key);
