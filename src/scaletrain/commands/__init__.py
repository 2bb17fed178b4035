"""The command line's subcommands, one module each (`add_parser(subparsers)` and its `func(args) -> int`); `cli.py`
lists them. Commands parse, check and print; the work is done by the packages below them."""
