"""Delivery-event webhooks of sending providers: one module per signing scheme."""
