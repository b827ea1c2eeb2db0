"""Tests of device_agent.agent: local datasets and the durable telemetry buffer."""
