"""What operators see: batchfleet status, the dashboard, the fleet's history, batch jobs as read from Redis."""
