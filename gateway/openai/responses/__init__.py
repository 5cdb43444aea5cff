"""/v1/responses: request bodies, items, routes, answer objects and stored responses."""
