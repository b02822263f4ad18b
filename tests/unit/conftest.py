"""Fixtures shared by the unit tests: the in-sandbox agent run on the host (from test_agent)."""

from tests.unit.test_agent import agent, agent_binary, own_agent  # noqa: F401 - fixtures re-exported
