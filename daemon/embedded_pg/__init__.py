"""The PostgreSQL inboxd starts for itself when no DSN is configured."""
