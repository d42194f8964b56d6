-- The console's search (by run id or business id) and its overview of the last hour. The
-- time indexes are BRIN: rows arrive in time order, so a block range summary is enough, and it
-- costs an insert almost nothing.
create index intents_run on intents (run_id);
create index intents_business on intents (business_id) where business_id is not null;
create index intents_created_brin on intents using brin (created_at);
create index deliveries_received_brin on deliveries using brin (received_at);
