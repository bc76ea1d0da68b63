"""Generated gRPC stubs for the ``jaxserve.v1`` API (source: protos/jaxserve/v1/jaxserve.proto).

Do not edit the ``*_pb2*`` modules: regenerate them with ``python -m jaxserve.server.gen_protos``.
"""
