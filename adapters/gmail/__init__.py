"""Gmail door."""
