"""The HTTP routes: thin layers that parse a request, call the core and shape the answer."""
