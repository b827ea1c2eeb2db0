"""Alembic environment for the run store: always run by host.fleet.store with a live connection.

There is no alembic.ini: ``host.fleet.store.alembic_config`` builds the Config in code and puts the
open connection in ``config.attributes["connection"]``; migrations run inside that connection's
transaction, so a failed upgrade leaves the database as it was (SQLite and PostgreSQL both have
transactional DDL).
"""

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("the run store's migrations run from host.fleet.store (RunStore(url) upgrades on open)")

# render_as_batch: SQLite cannot ALTER most things in place; batch mode copies the table instead.
context.configure(connection=connection, target_metadata=None, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
