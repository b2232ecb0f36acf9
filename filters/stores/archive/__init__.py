"""The non-repudiation archive (docs/audit.md): records (record.py), the embedded segment store (segments.py),
PostgreSQL (postgres.py) and the worker's writer off the hot path (writer.py)."""
