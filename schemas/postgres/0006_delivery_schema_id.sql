-- An action written by Confluent's JSON Schema serializer carries a Schema Registry frame
-- (a zero byte, then the schema id); the relay strips it and keeps the id with the delivery,
-- so `explain` can say which schema version the producer registered.
alter table deliveries add column schema_id integer;
