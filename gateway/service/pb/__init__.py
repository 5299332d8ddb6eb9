"""Generated gRPC stubs of proto/kvgate/v1/kvgate.proto (python -m gateway.service.protogen)."""
