"""Model architectures: specifications, the published catalog and FLOP / byte accounting. Never imports torch."""
