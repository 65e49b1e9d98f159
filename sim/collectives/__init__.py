"""Collective algorithms as explicit point-to-point schedules, and their closed-form costs."""
