"""The Outlook door: Microsoft Graph mail through msgraph-sdk (config, tokens, pacing,
delta sync, $batch bodies, subscriptions).

    config.py         the `[outlook]` table and outlook mailbox entries
    errors.py         Graph's answers as pipeline/errors.py's tree
"""
