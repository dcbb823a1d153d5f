# pagellm_doc_example/__init__.py
"""A pagellm platform (PLAIN_CPU) and a paged attention backend in plain torch (PLAIN_TORCH)."""
