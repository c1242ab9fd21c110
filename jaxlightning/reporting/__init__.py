"""Reported values and where they go: `report` (names and values from fetched
metric states, Lightning's naming), `batch_logs` (what the training batch
hooks log on the host) and `Reporter` (``callback_metrics``, the progress
bar's and the loggers' values, the run directory)."""
