"""OpenAI's files and batches API: routes, stored files and batch records, expiry, the runner and its lines."""
