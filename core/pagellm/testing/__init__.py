"""Test support shipped with pagellm: the conformance kit (`pagellm.testing.conformance`), which
platform and attention-backend vendors run against their plugins, and `pagellm.testing.greedy`,
which compares two greedy runs (two backends, graphs against eager steps) up to a near-tie."""
