"""Calibration, validation and the command-line interface, which sit on top of sim and runtime."""
