"""torchtext.data: only its ``utils`` module is answered here."""
