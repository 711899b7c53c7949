"""How many examples a Hypothesis test runs: the count a test names is its count under the `thorough` profile
(Hypothesis' own 100 examples a test); `make test` loads the `radixkv` profile (tests/conftest.py), a third of
that, so the suite stays a few minutes on two cores. `pytest --hypothesis-profile=thorough` runs every count
as written (CI does)."""

from hypothesis import settings

THOROUGH = 100  # max_examples of the thorough profile: Hypothesis' default


def examples(count: int) -> int:
    """`count` scaled by the profile in force: count x its max_examples / THOROUGH, at least 10."""
    return max(10, round(count * settings.default.max_examples / THOROUGH))
