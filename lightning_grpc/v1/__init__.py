"""Generated stubs of the lightning.v1 contract (scripts/gen_protos.py; do not edit)."""
