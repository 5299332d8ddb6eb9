"""The gRPC surface: servicers, the server, authentication, the one error-to-status mapping,
and Prometheus metrics. Only this package (and the client) imports the generated stubs."""
