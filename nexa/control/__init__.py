"""`nexa control`: the controller role."""
