"""Examples built on rankattn (run from the repository root: ``python -m examples.<name>``)."""
