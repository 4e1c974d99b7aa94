"""The fault-injection tests use the connector's test-only keys, which are refused
unless this switch is on; engines started by the tests (servers included) inherit it."""

import os

os.environ.setdefault("KVTIER_ENABLE_TEST_KEYS", "1")
