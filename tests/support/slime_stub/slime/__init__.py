"""A stand-in for THUDM/slime's package, for the tests (see ../README.md)."""
