"""The canonical state: an optimizer's state with no topology left in it, and its tensor sources.

Imports only gefen_ckpt.errors (torch only for annotations)."""
