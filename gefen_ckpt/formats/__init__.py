"""Other checkpoint formats and conversions: torch.save'd state_dicts, naming them, between optimizers.

May import gefen_ckpt.io, .state, .wire."""
