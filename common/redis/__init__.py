"""Everything about Redis the producer and worker sides share: clients, URLs, key names, retries, Lua functions, fleet
state."""
