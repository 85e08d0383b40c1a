"""The broker and provider process fixtures, shared with the broker's tests."""

from tests.test_broker.conftest import broker, provider

__all__ = ["broker", "provider"]
