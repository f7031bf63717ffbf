"""A mailbox's row: who syncs it (leases, presence), its cursor, when it polls next, its status."""
