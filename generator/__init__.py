"""Task plug-ins: every *_generator.py here is discovered by the service."""
