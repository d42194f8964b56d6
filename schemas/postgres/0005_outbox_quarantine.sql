-- An outcome event the producer refuses for good (larger than the broker accepts, an invalid
-- record) is set aside with the reason, so the rows after it are published; it stays in the
-- table for `explain` and for a person, and `idem_outbox_quarantined_total` counts it.
alter table outbox add column quarantined_at timestamptz;
alter table outbox add column quarantine_reason text;

drop index outbox_unpublished;
create index outbox_unpublished on outbox (id) where published_at is null and quarantined_at is null;
