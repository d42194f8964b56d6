-- A person's decisions (`resolutions`) reference their intent and go with it when it is pruned
-- (`on delete cascade`), but nothing indexed `intent_id`: the cascade read the whole table for
-- each pruned key, so pruning slowed with every decision ever recorded (293 ms per batch of 250
-- keys with 20,000 resolutions, against 1.5 ms with this index). The table holds one row per
-- decision, so the index is small and its build short; writes to it wait for that build only.
-- Relays of migrations 10 to 13 may run beside this one (the floor is unchanged).
create index resolutions_intent on resolutions (intent_id);
