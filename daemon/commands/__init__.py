"""One module per `inboxd` subcommand; each exposes `register(subparsers, parent)`.

`register` adds the subcommand's parser and sets `handler` to an async function
`run(args) -> int` (the exit code) that raises `common.CommandError` for a
one-line failure.
"""
