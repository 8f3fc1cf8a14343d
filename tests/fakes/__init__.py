"""Fakes for hardware and libraries the tests cannot rely on."""
