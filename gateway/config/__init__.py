"""The one validated, frozen configuration object of `kvgate serve`: file parsing, secrets and
key files, and machine-fit checks."""
