"""Offline tools on canonical states: resharding plans and streaming diffs.

May import every floor below (.io, .state, .wire, .formats, .dist)."""
