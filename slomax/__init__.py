"""SLOMax: class-based admission with goodput feedback (pure policy)."""
