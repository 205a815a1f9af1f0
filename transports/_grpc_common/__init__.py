"""Support shared by the built-in transports whose control plane is gRPC.

Not a transport: grpc, grpc+local and grpc+verbs use it for their control
server (binding, TLS, the token gate, connection limits), their client channels
and the mapping of gRPC failures to clusterwire errors, so none of them imports
another's modules. Plugins outside this package must not rely on it.
"""
