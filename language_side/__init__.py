"""language_side."""
