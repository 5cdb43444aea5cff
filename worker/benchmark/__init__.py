"""``batchfleet bench``: load generation through the real Redis path (or in-process) and reports."""
