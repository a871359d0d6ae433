"""Command-line tools: thin mains over the library."""
