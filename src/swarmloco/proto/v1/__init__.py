"""Generated protobuf and gRPC code of the swarmloco.v1 wire contract."""
