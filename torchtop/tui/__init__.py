"""The Textual viewer. Never imports torch."""
