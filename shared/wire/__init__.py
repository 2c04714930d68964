"""Conversions between the generated protobuf messages (`shared.proto_gen`) and our records.

Torch-free: both the coordinator and the workers use them.
"""
