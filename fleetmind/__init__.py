"""FleetMind: picks the site for a request and plans replica placement (pure policy)."""
