"""LunaNexa: a model-as-a-service and GPU-cluster control plane."""

__version__ = "0.1.0"
