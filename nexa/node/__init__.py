"""`nexa node`: the node agent role."""
