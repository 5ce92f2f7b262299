"""Examples to read and run from a source checkout (see examples/README.md)."""
