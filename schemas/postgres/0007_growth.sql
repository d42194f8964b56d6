-- Costs that must stay flat as the tables grow.
--
-- The console's overview of the last hour. BRIN: rows arrive in time order, so a summary per
-- block range is enough, and it costs an insert almost nothing. (B-tree indexes on run_id and
-- business_id for the console's search were measured at a fifth more Postgres CPU per action:
-- every non-HOT update of an intent adds an entry to each index. The search scans instead.)
create index intents_created_brin on intents using brin (created_at);
create index deliveries_received_brin on deliveries using brin (received_at);

-- Pruning deletes intents, and the foreign key deletes their deliveries by intent_id: with only
-- a partial index (the unanswered ones) that was a scan of every delivery for each key pruned,
-- and with millions of keys pruning stood still. One full index serves both.
create index deliveries_intent on deliveries (intent_id);
drop index deliveries_waiting;
