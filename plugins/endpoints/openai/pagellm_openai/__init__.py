"""pagellm-openai: the OpenAI-compatible HTTP API as a pagellm endpoint plugin."""
