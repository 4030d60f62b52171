"""The model registry plane: runtimes, model versions, their lifecycle and aliases (`models`), the
controller's checks against OCI registries and S3 (`outbound`) and GGUF figures (`gguf_figures`).
It imports only the access plane and the store."""
