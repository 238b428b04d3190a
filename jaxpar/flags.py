"""Command-line options declared once, on the config dataclasses' fields (filled in by the CLI work)."""
