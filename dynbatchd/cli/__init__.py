"""Command-line interfaces: `dynbatchd` (the daemon) and `dynbatchctl` (its control tool)."""
