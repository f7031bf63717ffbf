"""IMAP door: any mail server's folders, synced by UID windows (source.py)."""
