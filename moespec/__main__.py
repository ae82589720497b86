"""`python -m moespec` runs the CLI."""

from moespec.cli.app import main

main()
