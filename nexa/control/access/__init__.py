"""The access plane: who may call the controller. API keys, their roles and tenants (`accounts`)."""
