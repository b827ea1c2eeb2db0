"""Meters on the device: memory sampling and energy (one file per meter)."""
