"""Memory estimation, starting points and measured tuning of micro-batch sizes and token budgets (docs/tuning.md)."""
