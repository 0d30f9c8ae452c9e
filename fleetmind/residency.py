"""Resolve the region policies that apply to a (tenant, model) into allowed sites and a home.

The resolution lives with the schema in `fleetcore.region_policy` (the site-chooser contract
in `fleetcore.policies` answers in its types); FleetMind's modules import it from here.
"""

from fleetcore.region_policy import PolicySet, Residency

__all__ = ["PolicySet", "Residency"]
