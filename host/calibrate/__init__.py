"""Fit a PlatformProfile to what the executor measured (its telemetry), so the next solve is priced on reality."""

from host.calibrate.fit import CalibrationError, calibrate_profile

__all__ = ["CalibrationError", "calibrate_profile"]
