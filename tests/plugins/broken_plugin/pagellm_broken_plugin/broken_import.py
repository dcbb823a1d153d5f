"""Fails at import, like a plugin whose dependency is missing."""

import pagellm_missing_dependency  # noqa: F401
