-- Deliveries and attempts are found by their intent, not by their key: each key has one intent
-- (read-only calls aside, which keep neither), and `explain` reaches both through it. The two
-- indexes by key were written on every action (an attempt's twice when its close was not a HOT
-- update) and read by `explain` alone; with millions of keys they were about a sixth of the
-- index pages each insert had to find in memory.
--
-- A dead-lettered delivery has no intent: the few that carry a key are still found by it.
-- Building that index reads the deliveries once (seconds per ten million rows), with writes to
-- them waiting meanwhile.
create index deliveries_unlinked_key on deliveries (idempotency_key) where intent_id is null;
drop index deliveries_key;
drop index attempts_key;
