"""Family d1."""
