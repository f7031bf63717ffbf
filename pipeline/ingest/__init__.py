"""The ingest stage: a batch of MessageData becomes rows, bytes and events in one transaction."""
