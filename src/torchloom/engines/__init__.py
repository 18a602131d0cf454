"""Thin launchers: start worker processes, pass the config, gather logs and the result."""
