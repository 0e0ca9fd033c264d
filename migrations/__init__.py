"""Alembic migrations: the only way the schema changes (same scripts on SQLite and PostgreSQL).

Run them with ``kmq-tracker migrate`` (or ``KMQ_MIGRATE_ON_START=true``).
"""
