"""CLI subcommands: each module has `configure(parser)` and `run(args) -> int`; no logic here."""
