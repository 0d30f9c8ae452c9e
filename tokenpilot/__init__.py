"""TokenPilot: picks the engine instance inside one site's model pool (pure policy)."""
