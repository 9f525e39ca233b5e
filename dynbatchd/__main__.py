"""`python -m dynbatchd` is `dynbatchd`."""

from dynbatchd.cli.dynbatchd import main

main()
