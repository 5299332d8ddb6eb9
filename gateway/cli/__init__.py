"""The `kvgate` command line: serve, generate, prewarm, admin, bench. Thin: parsing and printing."""
