"""Explain, the memory estimate, starting points and measured tuning (docs/tuning.md). Nothing in posttrain
imports this package except the CLI."""
