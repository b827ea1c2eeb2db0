"""The device agent (`poet-agent`): what a board keeps and runs for the fleet.

Local datasets (``datasets``, ``demo_data``) and the durable telemetry buffer (``buffer``) live here;
the gRPC client that registers, heartbeats and pulls jobs joins them. Training data never leaves the
board: nothing in this package puts samples into a message.
"""
