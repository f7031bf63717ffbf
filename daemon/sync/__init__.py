"""The sync machinery of `inboxd run`: how a doorbell becomes pages in the ingest queue.

    registry.py   provider name → the adapter's Source (one line per door)
    fleet.py      the set of mailbox runners: start, reconcile on SIGHUP, ring, cancel
    runner.py     one mailbox: doorbell → lease → pages → queue → settle → cursor
    queue.py      the bounded page queue and the ingest workers that drain it
    doorbell.py   LISTEN inboxd_doorbell (`inboxd sync now`, other replicas' pushes)
    scanner.py    claims mailboxes due for a poll and rings them

docs/architecture.md ("Syncing a mailbox") tells the whole story; the supervisor
(daemon/supervisor.py) only wires these together.
"""
