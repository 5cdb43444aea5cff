"""Tool calling: tools and tool_choice in requests, the model families' call formats, tool schemas."""
