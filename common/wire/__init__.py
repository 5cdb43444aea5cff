"""What crosses the wire: request/reply types and their codec, generation parameters, guides, priorities."""
