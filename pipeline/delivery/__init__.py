"""Delivery events: persistence, processing into evidence and suppressions."""
