"""Test support shipped with pagellm: the conformance kit (`pagellm.testing.conformance`), which
platform and attention-backend vendors run against their plugins."""
