"""The concepts every layer speaks: tracked entries and their states, tracked ranges, the
state machine that markers drive, the redelivery decision, and topic policies.

Pure: no I/O, no clock, nothing of the engine, the store, Kafka or the API (the import
contracts in pyproject.toml hold it to that). The store persists what these functions return,
the engine runs them on what it reads, the API shows them.
"""
