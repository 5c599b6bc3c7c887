"""embedding_side."""
