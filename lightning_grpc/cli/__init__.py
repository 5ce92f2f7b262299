"""The ``lightning-grpc`` command line."""
