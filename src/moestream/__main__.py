"""`python -m moestream` = the `moestream` command."""

from moestream.cli import main_entry

main_entry()
