"""Runnable examples of lightning-grpc (``python -m lightning_grpc.examples.<name>``)."""
