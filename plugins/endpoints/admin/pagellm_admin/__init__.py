"""pagellm-admin: the engine's scheduler and KV-cache state over HTTP (an endpoint plugin)."""
