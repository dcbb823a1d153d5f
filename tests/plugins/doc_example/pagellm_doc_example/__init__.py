# pagellm_doc_example/__init__.py
"""A pagellm platform (plain_cpu) and a paged attention backend in plain torch (PLAIN_TORCH)."""
