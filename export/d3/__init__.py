"""Family d3."""
