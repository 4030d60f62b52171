"""The container engine drivers (libpod, Docker Engine) and their HTTP transport."""
