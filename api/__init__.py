"""The kmq-tracker HTTP API (admin REST API and sidecar marker endpoint)."""
