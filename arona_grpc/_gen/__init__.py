"""Generated gRPC code; do not edit."""
