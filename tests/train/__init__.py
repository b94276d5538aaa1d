"""Draft training and prompt generation."""
