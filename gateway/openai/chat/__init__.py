"""/v1/completions and /v1/chat/completions: request bodies, messages, routes and answer objects."""
