"""Command-line tools: thin mains over the library (`python -m bigpretrain.tools.NAME`)."""
