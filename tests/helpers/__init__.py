"""Test data and clients shared by test modules, one module per topic (a test module never imports another test
module or a conftest: tests/unit/test_architecture.py). The e2e tests' server helpers are in tests/e2e/servers.py."""
