"""Command-line tools that run outside training (data preparation)."""
