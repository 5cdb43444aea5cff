"""/v1/embeddings: request bodies and the route."""
