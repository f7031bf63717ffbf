"""The configuration of `inboxd run`: main file, tenant files, their tables, secrets."""
