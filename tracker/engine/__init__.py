"""The tracker engine: marker ingest, the deadline store's state machine, redelivery."""
