"""The service: the app and its routes, the command line, settings, security, metrics, the jobs
that run generators, and the recording gateway.

The top of the house: it builds the buffer and its store, hands each job its writer, and may
import everything beneath it. Nothing beneath imports it (``.importlinter``).
"""
