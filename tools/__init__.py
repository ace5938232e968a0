"""Command-line tools around a daemon: status, warm, inspect, and starting a daemon process (spawn)."""
