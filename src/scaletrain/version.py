"""The package version, in a module of its own so that reading it imports nothing else (the package root also
registers validate()'s rules; the report, the CLI and the pre-flight check only need the version)."""

__version__ = "0.1.0"
