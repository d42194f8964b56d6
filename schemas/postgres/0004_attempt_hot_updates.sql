-- Closing an attempt changes no indexed column, so Postgres can update it in place (a HOT
-- update: no new index entries). Open attempts are found through (intent_id, seq) instead.
drop index attempts_open;
alter table attempts set (fillfactor = 80);
