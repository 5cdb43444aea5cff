"""OpenAI's API on the fleet: chat and completions, Responses, embeddings, tool calling."""
