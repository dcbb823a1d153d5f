"""pagellm-io-embeddings: sentence embeddings from a pooling model, served at /v1/embeddings."""
