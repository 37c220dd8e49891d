"""``python -m gefen_cli``: the same as the ``gefen-ckpt`` console script."""

from .app import main

main()
