"""Multi-process training: data parallelism and Ulysses sequence parallelism."""
