"""The extraction claim protocol: one validated result per message identity (architecture §10)."""
