"""Generated protobuf/gRPC stubs for every ``proto/*.proto``. Do not edit by hand:
regenerate with ``python -m shared.proto_gen.generate`` after changing a proto."""
