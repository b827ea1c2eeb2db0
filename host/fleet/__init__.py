"""The coordinator: gRPC service, agent registry, job dispatch, telemetry ingestion, run store, certificates."""
