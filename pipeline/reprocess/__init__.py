"""Re-deriving stored messages from their raw bytes, and attachments whose store failed."""
