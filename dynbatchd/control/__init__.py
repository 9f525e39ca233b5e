"""The control socket: a small request/reply protocol for `dynbatchctl`."""
