"""dynbatchd: a dynamic-batching inference daemon behind ZeroMQ."""

__version__ = "0.1.0"
