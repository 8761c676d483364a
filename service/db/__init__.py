"""Database layer: the typed ORM models, engine/session helpers and Alembic migrations."""
