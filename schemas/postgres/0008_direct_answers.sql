-- A repeat of a settled key whose outcomes are all published is answered straight to Kafka,
-- without an outbox row: its offset is stored only once Kafka acknowledged the answer. A
-- delivery answered that way keeps the status it was answered with (for `explain`), and when
-- the same record is read again (the relay died before its offset was stored) it is answered
-- again, under the same event id. Null: answered through the outbox, or not yet.
alter table deliveries add column direct_status text;
