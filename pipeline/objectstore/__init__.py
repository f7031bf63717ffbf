"""The object store contract and the stores every door shares (local directory, database tier)."""
