"""blockspec eval."""
